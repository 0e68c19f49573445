"""The transformers config of the model a ``ModelConfig`` describes, read without weights: the one reader of a
model's config (the data's context length, the attention's needs and ``build_model`` all start from it).
It sits beside ``trainer/model/``, not inside it, so that preparing the data (which needs the context length)
never imports the modelling code (``trainer.model``'s package imports torch's and transformers' model
classes: 2.6 s here); transformers itself is imported only when called."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.errors import ConfigError
from trainer.library_log import library_load

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from trainer.config import ModelConfig


def model_config(cfg: ModelConfig, base: dict | None = None) -> PretrainedConfig:
    """The transformers config of the model ``build_model`` trains, read without weights: ``name_or_path``'s
    with ``config_overrides`` applied, or ``family``'s built from ``base`` updated by ``random_init`` and
    ``config_overrides`` (``ModelConfig.init_fields``). Of a multimodal folder, its language model's
    (``language_model_config``): the model packfsdp trains, judges and sizes the data for."""
    return trained_config(folder_config(cfg, base))


def trained_config(config: PretrainedConfig) -> PretrainedConfig:
    """Of a model's (``folder_config``) config, the config of the model packfsdp trains: a multimodal
    model's language model's (``language_model_config``), else the config itself."""
    return language_model_config(config) or config


def folder_config(cfg: ModelConfig, base: dict | None = None) -> PretrainedConfig:
    """The config ``build_model`` loads the model with: ``model_config``'s, but of a multimodal folder the
    whole model's. ``config_overrides`` there go to the whole config where it has the field (``text_config``,
    say), else to its language model's (``max_position_embeddings``, ``attention_dropout``)."""
    from transformers import AutoConfig  # noqa: PLC0415 -- only when called: preparing the data imports no transformers

    fields = cfg.init_fields()
    if cfg.name_or_path:
        with library_load(f"model.name_or_path={cfg.name_or_path}"):
            config = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code, **fields)
        if (text := language_model_config(config)) is not None:
            for key, value in fields.items():
                if not hasattr(config, key) and hasattr(text, key):
                    setattr(text, key, value)
        return config
    with library_load(f"model.family={cfg.family}"):  # a config transformers rejects: one line, every caller
        config = AutoConfig.for_model(cfg.family, **((base or {}) | fields))
    if (text := language_model_config(config)) is not None:
        raise ConfigError(
            f"model.family={cfg.family} is a multimodal model: build its text family at random "
            f"(model.family={text.model_type}), or fine-tune a checkpoint's language model (model=hf "
            "model.name_or_path=DIR)"
        )
    return config


def language_model_config(config: PretrainedConfig) -> PretrainedConfig | None:
    """The text config of a multimodal model whose language model packfsdp trains as the causal LM of its
    text family (``trainer.model.multimodal``): a family of transformers' multimodal-LM mapping (Gemma 3/4,
    Llama 4, Qwen3.5, Mistral 3, LLaVA, ...) whose text config is a causal-LM family's. ``None`` otherwise."""
    from transformers.models.auto.modeling_auto import (  # noqa: PLC0415 -- only when called: preparing the data imports no transformers
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
    )

    if getattr(config, "model_type", None) not in MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES or config.is_encoder_decoder:
        return None
    text = config.get_text_config(decoder=True)
    return text if text is not config and text.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else None


def tokenizer_fields(tokenizer) -> dict:
    """What a model built from ``family`` takes from the tokenizer (``base`` of ``model_config``)."""
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


__all__ = ["folder_config", "language_model_config", "model_config", "tokenizer_fields", "trained_config"]
