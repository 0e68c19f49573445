"""What every config section shares: the choice lists that validation reads without importing torch, the
error every bad value raises, the two checks most fields use, and the reader of the transformers config a
``ModelConfig`` describes (``model_config``: transformers imported only when called)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from trainer.config.sections import ModelConfig

ATTENTION_BACKENDS = ("flash_attn", "torch_varlen", "flex", "sdpa_varlen", "sdpa_block_mask")
"""The packed attention backends ``model.attention`` may name besides ``auto``, in the order ``auto`` tries
them (fastest first). ``trainer.model.attention.BACKENDS`` registers exactly these; the names live here so
that validating a config never imports torch."""

CODE_OPTIONS = {"data.plugins": "PACKFSDP_PLUGINS", "model.trust_remote_code": "PACKFSDP_TRUST_REMOTE_CODE"}
"""Options that import user or remote code, and the environment variable that may set each instead of the
command line (a config file may not: ``trainer.cli.check_code_sources``). ``PACKFSDP_PLUGINS`` is a
comma-separated list added to ``data.plugins``; ``PACKFSDP_TRUST_REMOTE_CODE=1`` sets the flag."""

LOSS_IMPLS = ("chunked", "naive")
"""``loss.impl`` choices (``trainer.loss``): the LM head fused with the cross-entropy in chunks of tokens, or
the model's full logits then cross-entropy."""

CONTEXT_KEYS = ("n_positions", "max_position_embeddings")
"""Where a transformers config states the model's context length (GPT-2 names it ``n_positions``)."""


def stated_context(config: Any) -> int | None:
    """The context length a transformers config states, or ``None``. ``config`` is a transformers config
    (of a built model, or read without weights) or a plain dict of its fields (``ModelConfig.init_fields``)."""
    for key in CONTEXT_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if value:
            return int(value)
    return None


def model_config(cfg: ModelConfig, base: dict | None = None) -> PretrainedConfig:
    """The transformers config of the model ``build_model`` builds, read without weights: ``name_or_path``'s
    with ``config_overrides`` applied, or ``family``'s built from ``base`` updated by ``random_init`` and
    ``config_overrides`` (``ModelConfig.init_fields``). Here, not in ``trainer.model``, so that preparing the
    data (which needs the context length) never imports the modelling code."""
    from transformers import AutoConfig

    from trainer.library_errors import library_load

    if cfg.name_or_path:
        with library_load(f"model.name_or_path={cfg.name_or_path}"):
            return AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code, **cfg.init_fields())
    return AutoConfig.for_model(cfg.family, **((base or {}) | cfg.init_fields()))


LOCAL_PATH_PREFIXES = ("/", "./", "../", "~")
"""A ``name_or_path`` starting so is a local folder (a hub id never does), checked to exist at once."""


GENERATED_SOURCES = ("dailydialog_synthetic", "chat_synthetic", "reasoning_synthetic")
"""The sources ``trainer.data.sources`` generates offline (small: the local BPE may train on them even when
they are streamed)."""


class ConfigError(ValueError):
    """A configuration value is wrong. The message says which key and what to change."""



def check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(choices)}")


def check_positive(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{key} must be a positive number, got {value!r}")
