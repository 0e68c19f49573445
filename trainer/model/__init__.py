"""Stage 4: the model and its attention backends for packed (varlen) batches."""

from trainer.errors import SelfCheckError
from trainer.model.attention import (
    BACKENDS,
    AttentionBackend,
    AttentionBackendError,
    AttentionNeeds,
    attention_dropout,
    resolve_backend,
)
from trainer.model.certification import Certificate, certify, measure
from trainer.model.loading import DTYPES, build_model
from trainer.model.wrapper import VarlenCausalLM

__all__ = [
    "BACKENDS",
    "DTYPES",
    "AttentionBackend",
    "AttentionBackendError",
    "AttentionNeeds",
    "Certificate",
    "SelfCheckError",
    "VarlenCausalLM",
    "attention_dropout",
    "build_model",
    "certify",
    "measure",
    "resolve_backend",
]
