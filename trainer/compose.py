"""The Hydra side of the configuration: where the configs and recipes live, their registration in Hydra's
ConfigStore, and the one conversion of a composed ``DictConfig`` into a validated ``JobConfig``
(``to_job_config``). The schema itself is ``trainer.config``.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import MissingMandatoryValue, OmegaConf

from trainer.config import CODE_OPTIONS, ConfigError, JobConfig, retired_key
from trainer.safety import check_targets

_PACKAGE_DIR = Path(__file__).resolve().parent


def config_dir() -> Path:
    """The ``configs/`` folder: the repository's in a source checkout, the packaged copy when installed."""
    for candidate in (_PACKAGE_DIR.parent / "configs", _PACKAGE_DIR / "configs"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"packfsdp configs not found next to {_PACKAGE_DIR}")


def recipe_dirs() -> list[Path]:
    """Folders whose ``*.yaml`` files are offered as ``recipe=NAME``: the shipped recipes, then any listed
    in ``PACKFSDP_RECIPES`` (``os.pathsep``-separated). A user folder may also be added through Hydra's
    search path as ``<dir>/recipe/NAME.yaml``."""
    dirs = [d for d in (_PACKAGE_DIR.parent / "recipes", _PACKAGE_DIR / "recipes") if d.is_dir()][:1]
    extra = os.environ.get("PACKFSDP_RECIPES", "")
    dirs += [Path(p).expanduser() for p in extra.split(os.pathsep) if p]
    return dirs


def register_configs() -> None:
    """Register the schema (``job_schema``, the root of ``configs/config.yaml``'s defaults; the group YAMLs
    are typed through it) and every recipe with Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="job_schema", node=JobConfig)
    for directory in recipe_dirs():
        for path in sorted(directory.glob("*.yaml")):
            # Recipes live in recipes/ (not configs/recipe/) so users find them at the top of the repo;
            # they are stored as the `recipe` group at the global package, like `# @package _global_`.
            cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")


def _check_known_keys(raw: Any, node: Any, path: str = "") -> None:
    """``+key=value`` can add a key the schema does not have; ``to_object`` would drop it silently."""
    names = {f.name for f in fields(node)}
    for key in raw.keys():
        where = f"{path}{key}"
        if key not in names:
            if retired := retired_key(where):
                raise ConfigError(retired)
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {path}{close[0]}?" if close else ""
            raise ConfigError(f"unknown key {where!r}{hint}")
        if is_dataclass(getattr(node, key)):
            _check_known_keys(raw[key], getattr(node, key), f"{where}.")


def to_job_config(cfg: Any) -> JobConfig:
    """Turn a composed DictConfig into a validated JobConfig (the one place that sees OmegaConf)."""
    try:
        job = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:  # `???` in a YAML (e.g. data=jsonl without data.path)
        raise ConfigError(f"{e.full_key} must be set (e.g. {e.full_key}=...)") from None
    if not isinstance(job, JobConfig):
        raise ConfigError("the composed config does not follow the JobConfig schema")
    _check_known_keys(cfg, job)
    job.data.cache_dir = str(Path(job.data.cache_dir).expanduser())
    job.data.plugins += [p.strip() for p in os.environ.get(CODE_OPTIONS["data.plugins"], "").split(",") if p.strip()]
    if os.environ.get(CODE_OPTIONS["model.trust_remote_code"], "") == "1":
        job.model.trust_remote_code = True
    job.validate()
    # The one _target_ check: the whole config, before anything is instantiated (UnsafeTargetError).
    check_targets(asdict(job))
    return job


OPEN_MAPPINGS = ("model.config_overrides", "model.random_init")
"""Mappings of free-form transformers config fields: any key may be set, whether the preset has it or not."""


def open_mapping_overrides(overrides: list[str]) -> list[str]:
    """``model.config_overrides.n_layer=4`` works whether or not the preset sets ``n_layer``: Hydra would want
    ``+`` for a new key and refuse it for an existing one, so these keys are passed as ``++`` (add or set)."""
    return [f"++{arg}" if arg.partition("=")[0].startswith(OPEN_MAPPINGS) and "=" in arg else arg for arg in overrides]


def compose_job_config(overrides: list[str]) -> JobConfig:
    """Compose ``configs/config.yaml`` with command-line ``overrides`` and validate it, as a run would
    (for tools and tests; ``trainer.train`` composes through ``hydra.main``)."""
    register_configs()
    with initialize_config_dir(str(config_dir()), version_base=None):
        return to_job_config(compose("config", overrides=open_mapping_overrides(overrides)))
