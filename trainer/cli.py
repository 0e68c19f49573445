"""Command-line checks that run before Hydra: a wrong group option fails with one line."""

from __future__ import annotations

import sys

from hydra.core.config_store import ConfigStore

from trainer.config import config_dir

GROUPS = ("recipe", "model", "data", "packing", "parallel", "optim", "logger")


def group_choices(group: str) -> list[str]:
    """Options of a config group: YAML files under configs/<group>/ and ConfigStore entries (recipes)."""
    names = {p.stem for p in (config_dir() / group).glob("*.yaml")}
    stored = ConfigStore.instance().repo.get(group, {})
    names |= {key.removesuffix(".yaml") for key in stored if not key.endswith("_schema.yaml")}
    return sorted(names)


def check_group_choices(argv: list[str]) -> None:
    """Exit with one line naming the valid choices when ``group=option`` names no option.

    Skipped when the user extends Hydra's search path (their folder may add options we cannot see here).
    """
    if any(arg.startswith(("hydra.searchpath", "+hydra.searchpath")) for arg in argv):
        return
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in GROUPS or value in ("null", ""):
            continue
        choices = group_choices(key)
        for option in value.split(","):  # multirun sweeps: -m packing=none,bfd
            if option not in choices:
                print(f"packfsdp: unknown {key} {option!r}; choose one of: {', '.join(choices)}", file=sys.stderr)
                sys.exit(2)
