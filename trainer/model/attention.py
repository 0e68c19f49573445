"""Attention backends for packed (varlen) batches, all behind transformers' attention signature.

Every backend is a function ``fn(module, query, key, value, attention_mask, scaling, dropout, **kwargs)``
with ``query`` shaped ``[1, heads, total_tokens, head_dim]`` (one flat packed row) that returns
``(output [1, total_tokens, heads, head_dim], None)``. The example boundaries arrive as
``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 offsets) and ``max_length_q`` / ``max_length_k`` in
``kwargs`` (transformers 5 passes the model's ``**kwargs`` down to the attention function), the sliding
window as ``sliding_window``. Keys and values may have fewer heads than queries (GQA).

A packed call without boundaries is an error, never a silent fallback to attention over the whole row.

| backend           | where          | dtypes      | dropout | how                                            |
|-------------------|----------------|-------------|---------|------------------------------------------------|
| ``flash_attn``    | CUDA (sm80+)   | bf16, fp16  | yes     | flash-attn ``flash_attn_varlen_func`` (extra)  |
| ``torch_varlen``  | CUDA (sm80+)   | bf16, fp16  | no      | ``torch.nn.attention.varlen.varlen_attn``      |
| ``flex``          | CUDA           | all         | no      | FlexAttention, document-causal block mask      |
| ``sdpa_varlen``   | CPU, CUDA      | all         | yes     | exact causal SDPA per example (batched by length) |
| ``sdpa_block_mask`` | CPU, CUDA    | all         | yes     | SDPA with a block-diagonal causal mask         |

``auto`` takes the first one in that order that can run on the device, in the compute dtype, with what the
model's attention needs (``AttentionNeeds``: dropout, logit softcapping, sinks). Every backend supports
sliding windows and GQA. Softcapping (Gemma2): ``flash_attn`` and ``flex`` only. Attention sinks (gpt-oss's
``s_aux``): every backend (``trainer.model.sinks``; ``torch_varlen`` where its ``varlen_attn`` returns the
log-sum-exp: ``return_aux``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from trainer.config import ATTENTION_BACKENDS
from trainer.model.attention_needs import AttentionNeeds, attention_dropout
from trainer.model.backends_cuda import (
    flash_attn_attention,
    flash_attn_unavailable,
    flex_attention_backend,
    flex_unavailable,
    torch_varlen_attention,
    torch_varlen_sinks_unavailable,
    torch_varlen_unavailable,
)
from trainer.model.backends_sdpa import sdpa_block_mask_attention, sdpa_varlen_attention
from trainer.model.packed_layout import AttentionBackendError

log = logging.getLogger(__name__)

HF_PREFIX = "packfsdp_"


def _anywhere(device: torch.device, dtype: torch.dtype | None = None) -> str | None:
    return None


def _nothing_missing() -> str | None:
    return None


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    fn: Callable
    description: str
    unavailable: Callable[..., str | None]
    """``unavailable(device, dtype)``: why the backend cannot run there, or None when it can."""
    supports_dropout: bool = True
    supports_softcap: bool = False
    """Honours transformers' ``softcap`` (attention logit softcapping)."""
    sinks_unavailable: Callable[[], str | None] = _nothing_missing
    """Why the backend cannot apply attention sinks (``s_aux``) with the installed packages, or None."""
    min_head_dim: int = 0
    """The smallest head dim its kernel takes (FlexAttention's Inductor lowering: 16)."""
    requested: str = ""
    """What the user asked for (``auto`` or the name); set by ``resolve_backend``."""
    device: torch.device | None = None
    dtype: torch.dtype | None = None

    @property
    def hf_name(self) -> str:
        """The name registered with transformers' ``AttentionInterface``."""
        return HF_PREFIX + self.name


BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend(
            "flash_attn",
            flash_attn_attention,
            "flash-attn varlen kernel",
            flash_attn_unavailable,
            supports_softcap=True,
        ),
        AttentionBackend(
            "torch_varlen",
            torch_varlen_attention,
            "torch varlen_attn (flash kernel)",
            torch_varlen_unavailable,
            supports_dropout=False,
            sinks_unavailable=torch_varlen_sinks_unavailable,
        ),
        AttentionBackend(
            "flex",
            flex_attention_backend,
            "FlexAttention with a document-causal block mask",
            flex_unavailable,
            supports_dropout=False,
            supports_softcap=True,
            min_head_dim=16,  # seen on an H200, torch 2.11: "NYI: embedding dimension ... at least 16"
        ),
        AttentionBackend("sdpa_varlen", sdpa_varlen_attention, "exact causal SDPA per example", _anywhere),
        AttentionBackend(
            "sdpa_block_mask", sdpa_block_mask_attention, "SDPA with a block-diagonal causal mask", _anywhere
        ),
    )
}

# `auto` takes the first backend in this order that can run (fastest first); the config validates
# model.attention against the same names (tests/unit/test_attention_backends.py checks they agree).
AUTO_ORDER = ATTENTION_BACKENDS

# Opaque to torch.compile (parallel.compile=true): these loop over the per-example boundaries in Python,
# so a traced call would specialise on each batch's cu_seqlens and recompile for every packed batch.
# Compiled blocks break the graph here once instead. (Kernel backends are left to the compiler.)
_COMPILE_OPAQUE = ("sdpa_varlen", "sdpa_block_mask")

for _backend in BACKENDS.values():
    fn = torch.compiler.disable(_backend.fn) if _backend.name in _COMPILE_OPAQUE else _backend.fn
    AttentionInterface.register(_backend.hf_name, fn)


def _why_not(
    backend: AttentionBackend, device: torch.device, dtype: torch.dtype | None, needs: AttentionNeeds
) -> str | None:
    if reason := backend.unavailable(device, dtype):
        return reason
    if needs.dropout > 0 and not backend.supports_dropout:
        return f"it has no attention dropout and the model's attention dropout is {needs.dropout} (set it to 0)"
    if needs.head_dim is not None and needs.head_dim < backend.min_head_dim:
        return f"its kernel takes head dims of {backend.min_head_dim} and up and {needs.family}'s is {needs.head_dim}"
    if needs.softcap is not None and not backend.supports_softcap:
        capable = " or ".join(b.name for b in BACKENDS.values() if b.supports_softcap)
        return (
            f"it cannot honour {needs.family}'s attention softcapping (attn_logit_softcapping={needs.softcap}); "
            f"use model.attention={capable}"
        )
    if needs.sinks and (reason := backend.sinks_unavailable()):
        return f"it cannot honour {needs.family}'s attention sinks (s_aux): {reason}"
    return None


def resolve_backend(
    name: str, device: torch.device, dtype: torch.dtype | None = None, needs: AttentionNeeds = AttentionNeeds()
) -> AttentionBackend:
    """The backend for ``model.attention=name`` on ``device`` computing in ``dtype`` for a model whose
    attention ``needs`` what ``AttentionNeeds.of(config)`` says (default: plain causal attention); raises
    ``AttentionBackendError`` with a one-line reason if it cannot run."""
    device = torch.device(device)
    if name == "auto":
        reasons = []
        for candidate in AUTO_ORDER:
            reason = _why_not(BACKENDS[candidate], device, dtype, needs)
            if reason is None:
                return dataclasses.replace(BACKENDS[candidate], requested=name, device=device, dtype=dtype)
            reasons.append(f"{candidate}: {reason}")
        raise AttentionBackendError(f"no attention backend can run on {device} ({'; '.join(reasons)})")
    if name not in BACKENDS:
        raise AttentionBackendError(
            f"model.attention={name!r} is not a packed attention backend; choose one of: auto, {', '.join(BACKENDS)}"
        )
    if reason := _why_not(BACKENDS[name], device, dtype, needs):
        raise AttentionBackendError(f"model.attention={name} cannot run here: {reason}")
    return dataclasses.replace(BACKENDS[name], requested=name, device=device, dtype=dtype)


__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "AttentionBackend",
    "AttentionBackendError",
    "AttentionNeeds",
    "attention_dropout",
    "resolve_backend",
    "sdpa_block_mask_attention",
    "sdpa_varlen_attention",
]
