"""Build or load the transformers causal LM and wrap it for varlen batches."""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from trainer.config import DTYPE_NAMES, ModelConfig
from trainer.model_config import model_config, tokenizer_fields
from trainer.errors import library_load
from trainer.model.attention import AttentionBackend
from trainer.model.config_verdict import verify_config
from trainer.model.families import check_family
from trainer.model.mixers import describe as describe_mixers
from trainer.model.prepare import prepare_model
from trainer.model.wrapper import VarlenCausalLM

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, backend: AttentionBackend, seed: int) -> VarlenCausalLM:
    """A pretrained model (``name_or_path``) or a random one from ``family`` + ``random_init``, run
    through ``backend`` for packed batches. The trainer resolves ``backend`` once, against the model's
    attention needs (``trainer.pipeline.resolve_attention``).

    A family packfsdp cannot train packed exactly is refused first, from its config alone
    (``trainer.model.families``: one line, the family and the reason), then the config itself: a tiny
    float64 replica of it, packed vs one by one (``trainer.model.config_verdict``, cached by config hash).

    Random init is seeded identically on every rank: FSDP keeps each rank's shard of its *local* copy,
    so the copies must agree.
    """
    dtype = DTYPES[cfg.dtype]
    if cfg.name_or_path:
        config = model_config(cfg)
        check_family(config, cfg.self_check)
        verify_config(config)
        torch.manual_seed(seed)  # after the verdict: its replica draws numbers only on a cache miss
        with library_load(f"model.name_or_path={cfg.name_or_path}"):
            model = AutoModelForCausalLM.from_pretrained(
                cfg.name_or_path,
                dtype=dtype,
                attn_implementation=None,  # transformers' choice: SDPA, or eager where the family has none
                trust_remote_code=cfg.trust_remote_code,
                weights_only=True,  # a .bin checkpoint is never unpickled beyond tensors (safetensors preferred)
                **cfg.init_fields(),
            )
    else:
        config = model_config(cfg, base=tokenizer_fields(tokenizer))
        check_family(config, cfg.self_check)
        verify_config(config)
        torch.manual_seed(seed)  # after the verdict: its replica draws numbers only on a cache miss
        with library_load(f"model.family={cfg.family}"):  # one line where transformers cannot build it (dbrx)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=None)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.config.use_cache = False
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "model %s: %s, %.2fM parameters, %s", cfg.name_or_path or cfg.family, model.config.model_type, n_params / 1e6,
        cfg.dtype,
    )
    prepared = prepare_model(model, backend)
    for line in describe_mixers(prepared.token_mixers):
        log.info("%s", line)
    return prepared
