"""Command-line checks that run before Hydra: a wrong group option fails with one line."""

from __future__ import annotations

import os
import sys

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore

from trainer.config import config_dir, to_job_config
from trainer.safety import redact

GROUPS = ("recipe", "model", "data", "packing", "parallel", "optim", "logger")


def group_choices(group: str) -> list[str]:
    """Options of a config group: YAML files under configs/<group>/ and ConfigStore entries (recipes)."""
    names = {p.stem for p in (config_dir() / group).glob("*.yaml")}
    stored = ConfigStore.instance().repo.get(group, {})
    names |= {key.removesuffix(".yaml") for key in stored}
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


def one_line(exc: BaseException) -> str:
    """A Hydra/OmegaConf/packfsdp config error as one line: the key, then what is wrong with it."""
    cause = exc.__cause__ or exc
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    key = getattr(cause, "full_key", None)
    return redact(f"{key}: {first}" if key and key not in first else first)


def check_overrides(argv: list[str]) -> None:
    """Compose and validate the config exactly as the run will, before Hydra starts the job, so a wrong
    type, an unknown key or a bad value fails with one line (Hydra's own report spans several) and before
    any process group exists.

    Skipped for Hydra's own flags (``--multirun``, ``--cfg``, ...) and search-path extensions, which this
    check cannot reproduce; the run still validates its config then, with one line for packfsdp's checks.
    """
    if any(arg.startswith("-") or "hydra.searchpath" in arg for arg in argv):
        return
    overrides = [arg for arg in argv if not arg.lstrip("+~").startswith("hydra.")]
    try:
        with initialize_config_dir(str(config_dir()), version_base=None):
            raw = compose("config", overrides=overrides)
        to_job_config(raw).validate_world(int(os.environ.get("WORLD_SIZE", 1)))  # the launch fits the mesh
    except Exception as e:  # noqa: BLE001 - every composition/validation error is a config error here
        print(f"packfsdp: config error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
