"""Stage 4: the model and its attention backends for packed (varlen) batches."""

from trainer.model.attention import (
    BACKENDS,
    AttentionBackend,
    AttentionBackendError,
    AttentionNeeds,
    attention_dropout,
    resolve_backend,
)
from trainer.model.loading import DTYPES, build_model
from trainer.model.selfcheck import SelfCheckError, self_check
from trainer.model.wrapper import VarlenCausalLM

__all__ = [
    "BACKENDS",
    "DTYPES",
    "AttentionBackend",
    "AttentionBackendError",
    "AttentionNeeds",
    "SelfCheckError",
    "VarlenCausalLM",
    "attention_dropout",
    "build_model",
    "resolve_backend",
    "self_check",
]
