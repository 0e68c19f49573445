"""Command-line checks that run before Hydra: a wrong group option fails with one line, and a config that
would make Hydra or the run import code nobody named on the command line is refused (``check_code_sources``).
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys

from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from trainer.compose import config_dir, to_job_config
from trainer.config import CODE_OPTIONS, retired_key
from trainer.errors import first_line
from trainer.safety import UnsafeTargetError, check_target, check_targets, printable, redact


def config_groups() -> tuple[str, ...]:
    """The config groups a ``group=option`` override may name: ``recipe`` and every folder under configs/."""
    return ("recipe", *sorted(p.name for p in config_dir().iterdir() if p.is_dir()))


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
    groups = config_groups()
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in groups or value in ("null", ""):
            continue
        choices = group_choices(key)
        for option in value.split(","):  # multirun sweeps: -m packing=none,bfd
            if option not in choices:
                print(f"packfsdp: unknown {key} {option!r}; choose one of: {', '.join(choices)}", file=sys.stderr)
                sys.exit(2)


def one_line(exc: BaseException) -> str:
    """A Hydra/OmegaConf/packfsdp config error as one line: the key, then what is wrong with it."""
    cause = exc.__cause__ or exc
    first = first_line(cause, limit=None)
    key = getattr(cause, "full_key", None)
    if key and (retired := retired_key(key)):  # a key the schema no longer has: say where its fact went
        return retired
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


HYDRA_INSTANTIATED = ("callbacks", "launcher", "sweeper")
"""``hydra.*`` sections Hydra instantiates (``_target_``) before the job starts."""
HYDRA_LOGGING = ("job_logging", "hydra_logging")
"""``logging.config.dictConfig`` sections: their ``()`` and ``class`` values are imported and called."""
TARGET_KEYS = ("_target_", "()", "class")


def config_error(message: str) -> None:
    print(f"packfsdp: config error: {printable(redact(message))}", file=sys.stderr)
    sys.exit(2)


def check_code_sources(argv: list[str]) -> None:
    """Before Hydra starts: no ``hydra.*`` key makes Hydra instantiate something outside its own launcher,
    sweeper and logging (whether it comes from the command line, a recipe or a YAML on ``hydra.searchpath``),
    and options that import user or remote code (``CODE_OPTIONS``) are set on the command line or through
    their environment variable, never by a config file. Each value of a sweep (``-m a=x,y``) is checked."""
    args, _ = get_args_parser().parse_known_args(argv)  # Hydra's own reading of its flags and overrides
    if args.config_path or args.config_name or args.config_dir:
        config_error(
            "--config-path/--config-name/--config-dir are not supported (a primary config outside "
            "packfsdp is not checked); put your YAML under hydra.searchpath=[file://DIR], use recipe=NAME"
        )
    try:
        parsed = OverridesParser.create().parse_overrides(args.overrides)
    except Exception as e:  # noqa: BLE001 - Hydra will refuse the same line; say it in one line here
        config_error(one_line(e))
    overrides, on_command_line = [], set()
    for override in parsed:
        key = override.get_key_element()
        on_command_line.add(key.lstrip("+~"))
        values = list(override.sweep_string_iterator()) if override.is_sweep_override() else None
        if values and key.lstrip("+~").startswith("hydra.") and key.rsplit(".", 1)[-1] in TARGET_KEYS:
            for value in values:  # every job of the sweep, not only the first one composed below
                check_or_exit(lambda k=key, v=value: check_target(k, v, hydra_builtin_objects(), "hydra._internal."))
        overrides.append(f"{key}={values[0]}" if values else override.input_line)
    try:
        with initialize_config_dir(str(config_dir()), version_base=None):
            raw = compose("config", overrides=overrides, return_hydra_config=True)
    except Exception as e:  # noqa: BLE001
        config_error(one_line(e))
    check_or_exit(lambda: check_hydra_targets(raw.hydra))
    for key, env in CODE_OPTIONS.items():
        section, name = key.split(".")
        if raw[section][name] and key not in on_command_line:
            config_error(
                f"{key}={raw[section][name]} is set by a config file; options that import code are taken "
                f"only from the command line ({key}=...) or the environment ({env})"
            )


def check_or_exit(check) -> None:
    try:
        check()
    except UnsafeTargetError as e:
        config_error(str(e))


def check_hydra_targets(hydra_cfg) -> None:
    node = OmegaConf.to_container(hydra_cfg, resolve=False)
    for section in HYDRA_INSTANTIATED:
        check_targets(node.get(section), f"hydra.{section}", hydra_builtin_objects(), "hydra._internal.")
    for section in HYDRA_LOGGING:
        check_targets(node.get(section), f"hydra.{section}", logging_objects(), "logging.", keys=TARGET_KEYS)


def hydra_builtin_objects() -> frozenset:
    """Hydra's own launcher and sweeper (the defaults of ``hydra/launcher`` and ``hydra/sweeper``)."""
    # Imported at the call: Hydra's plugin scan loads these modules again, and a target resolves to the classes
    # of the modules as they are now, not as they were when this module was imported.
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher  # noqa: PLC0415 -- see above
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # noqa: PLC0415 -- see above

    return frozenset({BasicLauncher, BasicSweeper})


def logging_objects() -> frozenset:
    """The handler, formatter and filter classes of the standard ``logging`` package."""
    return frozenset(
        obj
        for module in (logging, logging.handlers)
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, (logging.Handler, logging.Formatter, logging.Filter))
    )
