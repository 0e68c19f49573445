"""The transformers config of the model a ``ModelConfig`` describes, read without weights: the one reader of a
model's config (the data's context length, the attention's needs and ``build_model`` all start from it).
It sits beside ``trainer/model/``, not inside it, so that preparing the data (which needs the context length)
never imports the modelling code (``trainer.model``'s package imports torch's and transformers' model
classes: 2.6 s here); transformers itself is imported only when called."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.errors import library_load

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from trainer.config import ModelConfig


def model_config(cfg: ModelConfig, base: dict | None = None) -> PretrainedConfig:
    """The transformers config of the model ``build_model`` builds, read without weights: ``name_or_path``'s
    with ``config_overrides`` applied, or ``family``'s built from ``base`` updated by ``random_init`` and
    ``config_overrides`` (``ModelConfig.init_fields``)."""
    from transformers import AutoConfig

    if cfg.name_or_path:
        with library_load(f"model.name_or_path={cfg.name_or_path}"):
            return AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code, **cfg.init_fields())
    with library_load(f"model.family={cfg.family}"):  # a config transformers rejects: one line, every caller
        return AutoConfig.for_model(cfg.family, **((base or {}) | cfg.init_fields()))


def tokenizer_fields(tokenizer) -> dict:
    """What a model built from ``family`` takes from the tokenizer (``base`` of ``model_config``)."""
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


__all__ = ["model_config", "tokenizer_fields"]
