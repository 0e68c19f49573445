"""Build or load the transformers causal LM and wrap it for varlen batches."""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

import trainer.model.multimodal as multimodal
from trainer.config import DTYPE_NAMES, ModelConfig
from trainer.library_log import library_load
from trainer.model.attention import AttentionBackend
from trainer.model.certification import certify_config
from trainer.model.mixers import describe as describe_mixers
from trainer.model.prepare import prepare_model
from trainer.model.wrapper import VarlenCausalLM
from trainer.model_config import folder_config, model_config, tokenizer_fields, trained_config

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def build_model(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, backend: AttentionBackend, seed: int
) -> VarlenCausalLM:
    """A pretrained model (``name_or_path``) or a random one from ``family`` + ``random_init``, run
    through ``backend`` for packed batches. The trainer resolves ``backend`` once, against the model's
    attention needs (``trainer.pipeline.resolve_attention``).

    Before any weight is loaded, the certification's first stages judge the config
    (``trainer.model.certification.certify_config``: the family table, then a tiny float64 replica of the
    config, packed vs one by one, cached): a family or setting packfsdp cannot train packed exactly is
    refused in one line naming it. The wrapper carries the certificate (``certificate``); the trainer's
    startup self-check completes it.

    A multimodal folder (``trainer.model.multimodal``) trains its language model, judged as its text family;
    the vision / audio tower and projector stay out of the step, kept for export (the wrapper's
    ``multimodal``; ``None`` for any other model).

    Random init is seeded identically on every rank: FSDP keeps each rank's shard of its *local* copy,
    so the copies must agree.
    """
    dtype = DTYPES[cfg.dtype]
    kept = None
    if cfg.name_or_path:
        whole = folder_config(cfg)
        config = trained_config(whole)  # model_config(cfg): a multimodal model's language model's
        if whole is not config:
            log.info(
                "%s: a multimodal %s; its language model is judged and trained as %s, the rest is kept aside",
                cfg.name_or_path,
                whole.model_type,
                config.model_type,
            )
        certificate = certify_config(config, cfg.self_check)
        torch.manual_seed(seed)  # after the verdict: its replica draws numbers only on a cache miss
        load = dict(
            dtype=dtype,
            attn_implementation=None,  # transformers' choice: SDPA, or eager where the family has none
            trust_remote_code=cfg.trust_remote_code,
            weights_only=True,  # a .bin checkpoint is never unpickled beyond tensors (safetensors preferred)
        )
        with library_load(f"model.name_or_path={cfg.name_or_path}"):
            if whole is not config:  # multimodal: its language model trained, the rest kept aside
                model, kept = multimodal.load(cfg.name_or_path, whole, **load)
            else:
                model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, **load, **cfg.init_fields())
    else:
        config = model_config(cfg, base=tokenizer_fields(tokenizer))
        certificate = certify_config(config, cfg.self_check)
        torch.manual_seed(seed)  # after the verdict: its replica draws numbers only on a cache miss
        with library_load(f"model.family={cfg.family}"):  # one line where transformers cannot build it (dbrx)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=None)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        if kept is not None:
            raise multimodal.MultimodalError(
                f"the tokenizer has {len(tokenizer)} tokens, {cfg.name_or_path}'s embeddings "
                f"{model.get_input_embeddings().num_embeddings}: a multimodal model trains with its own vocabulary"
            )
        model.resize_token_embeddings(len(tokenizer))
    model.config.use_cache = False
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "model %s: %s, %.2fM parameters, %s",
        cfg.name_or_path or cfg.family,
        model.config.model_type,
        n_params / 1e6,
        cfg.dtype,
    )
    wrapped = prepare_model(model, backend)
    for line in describe_mixers(wrapped.token_mixers):
        log.info("%s", line)
    wrapped.multimodal = kept
    wrapped.certificate = certificate
    return wrapped
