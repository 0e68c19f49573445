"""Attention backends for packed (varlen) batches, all behind transformers' attention signature.

Every backend is a function ``fn(module, query, key, value, attention_mask, scaling, dropout, **kwargs)``
with ``query`` shaped ``[1, heads, total_tokens, head_dim]`` (one flat packed row) that returns
``(output [1, total_tokens, heads, head_dim], None)``. The example boundaries arrive as
``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 offsets) and ``max_length_q`` / ``max_length_k`` in
``kwargs``: transformers 5 passes the model's ``**kwargs`` down to the attention function.

A packed call without boundaries is an error, never a silent fallback to attention over the whole row.

Backends:
- ``sdpa_varlen``: exact causal SDPA on each example separately (CPU and GPU). The reference.
- ``sdpa_block_mask``: one SDPA call with a block-diagonal causal mask (CPU and GPU)::

      a a a . . .      example a: tokens 0-2, example b: tokens 3-5
      . a a . . .      (row = query, column = key; transposed view of "may attend")
      . . a . . .
      . . . b b b
      . . . . b b
      . . . . . b
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

log = logging.getLogger(__name__)

HF_PREFIX = "packfsdp_"


class AttentionBackendError(RuntimeError):
    """The configured attention backend cannot run here, or cannot keep packed examples apart."""


def _boundaries(kwargs: dict) -> torch.Tensor:
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise AttentionBackendError(
            "packed attention was called without cu_seq_lens_q: the example boundaries did not reach the "
            "attention function, so it cannot keep examples apart (refusing to attend across them)"
        )
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
        raise AttentionBackendError("cu_seq_lens_k differs from cu_seq_lens_q; packed self-attention needs both equal")
    return cu


def _check_packed(query: torch.Tensor, cu: torch.Tensor) -> None:
    if query.shape[0] != 1:
        raise AttentionBackendError(f"packed attention expects one flat row, got batch size {query.shape[0]}")
    if int(cu[-1]) != query.shape[2]:
        raise AttentionBackendError(f"cu_seqlens ends at {int(cu[-1])} but the row holds {query.shape[2]} tokens")


def sdpa_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal SDPA on each example of the packed row, one call per example (exact)."""
    cu = _boundaries(kwargs)
    _check_packed(query, cu)
    gqa = query.shape[1] != key.shape[1]
    bounds = cu.tolist()
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
            dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa,
        )
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def document_causal_mask(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Boolean ``[T, T]`` mask: query t may attend key s iff same example and s <= t."""
    total = int(cu_seqlens[-1])
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=device, dtype=torch.long)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    pos = torch.arange(total, device=device)
    return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


def sdpa_block_mask_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One SDPA call over the whole row with a block-diagonal causal mask (O(T^2) mask memory)."""
    cu = _boundaries(kwargs)
    _check_packed(query, cu)
    mask = document_causal_mask(cu, query.device)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    fn: Callable
    description: str
    unavailable: Callable[[torch.device], str | None]
    """Returns why the backend cannot run on this device, or None when it can."""

    @property
    def hf_name(self) -> str:
        """The name registered with transformers' ``AttentionInterface``."""
        return HF_PREFIX + self.name


def _anywhere(device: torch.device) -> str | None:
    return None


BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend("sdpa_varlen", sdpa_varlen_attention, "exact causal SDPA per example", _anywhere),
        AttentionBackend(
            "sdpa_block_mask", sdpa_block_mask_attention, "one SDPA call with a block-diagonal causal mask", _anywhere
        ),
    )
}

# `auto` takes the first backend in this order that can run on the device.
AUTO_ORDER = ("sdpa_varlen",)

for _backend in BACKENDS.values():
    AttentionInterface.register(_backend.hf_name, _backend.fn)


def resolve_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend to use for ``model.attention=name`` on ``device``; raises with the reason if it cannot run."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            if BACKENDS[candidate].unavailable(device) is None:
                return BACKENDS[candidate]
        raise AttentionBackendError(f"no attention backend can run on {device}")
    if name not in BACKENDS:
        raise AttentionBackendError(
            f"model.attention={name!r} is not a packed attention backend; choose one of: auto, {', '.join(BACKENDS)}"
        )
    reason = BACKENDS[name].unavailable(device)
    if reason:
        raise AttentionBackendError(f"model.attention={name} cannot run here: {reason}")
    return BACKENDS[name]
