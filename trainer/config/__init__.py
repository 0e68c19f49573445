"""Typed configuration: one dataclass per component (every field, its type, its meaning, its checks).

YAML files under ``configs/`` only set values; the schema, defaults and docs live here. ``trainer.compose``
registers it in Hydra's ConfigStore and turns the composed ``DictConfig`` into a ``JobConfig`` once
(``to_job_config``); nothing below ``main()`` sees a ``DictConfig``.

- ``sections``: what is trained on what (``data``, ``model``, ``packing``, ``parallel``);
- ``training``: how a run trains and keeps its work (``loss``, ``optim``, ``peft``, ``logger``, ``eval``,
  ``checkpoint``, ``guard``);
- ``job``: ``JobConfig``, the run-level fields and the checks that span sections;
- ``common``: the shared choice lists, ``ConfigError`` and the field checks.
"""

from __future__ import annotations

from omegaconf import MISSING

from trainer.config.common import (
    ATTENTION_BACKENDS,
    CODE_OPTIONS,
    CONTEXT_KEYS,
    CP_SPLITS,
    DTYPE_NAMES,
    GENERATED_SOURCES,
    LOCAL_PATH_PREFIXES,
    LOSS_IMPLS,
    ConfigError,
    retired_key,
    stated_context,
)
from trainer.config.distill import DistillConfig
from trainer.config.job import JobConfig
from trainer.config.sections import DataConfig, MixtureConfig, ModelConfig, PackingConfig, ParallelConfig, StreamConfig
from trainer.config.training import (
    OBJECTIVES,
    PEFT_METHODS,
    CheckpointConfig,
    DPOConfig,
    EvalConfig,
    GuardConfig,
    LoggerConfig,
    LossConfig,
    OptimConfig,
    PeftConfig,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "CODE_OPTIONS",
    "CONTEXT_KEYS",
    "CP_SPLITS",
    "DTYPE_NAMES",
    "GENERATED_SOURCES",
    "LOCAL_PATH_PREFIXES",
    "LOSS_IMPLS",
    "MISSING",
    "OBJECTIVES",
    "PEFT_METHODS",
    "CheckpointConfig",
    "ConfigError",
    "DPOConfig",
    "DistillConfig",
    "DataConfig",
    "EvalConfig",
    "GuardConfig",
    "JobConfig",
    "LoggerConfig",
    "MixtureConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "PackingConfig",
    "ParallelConfig",
    "StreamConfig",
    "PeftConfig",
    "retired_key",
    "stated_context",
]
