"""What every packed attention backend needs from transformers' kwargs, computed once per forward.

A packed row ``[1, heads, T, head_dim]`` holds examples back to back; ``cu_seqlens`` (``cu_seq_lens_q`` in
transformers' kwargs) gives their boundaries. ``packed_args`` checks the call and returns the boundaries,
the longest example and the sliding window (Mistral, Qwen sliding layers). ``PackedLayout`` derives, once
per ``cu_seqlens`` tensor (every layer of one forward sees the same tensor object), the host-side lengths
and the gather plans that let the SDPA backends run a few batched calls instead of one per example.

Sliding window, as transformers defines it: query ``t`` may attend key ``s`` iff ``t - W < s <= t``
(the last ``W`` tokens, itself included), and the window never leaves the example.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch


class AttentionBackendError(RuntimeError):
    """The configured attention backend cannot run here, or cannot keep packed examples apart."""


@dataclass(frozen=True)
class PackedArgs:
    cu_seqlens: torch.Tensor
    """int32 offsets of the examples in the row, length ``num_examples + 1``."""
    max_seqlen: int
    window: int | None
    """Sliding window in tokens (``None``: full causal attention)."""


def packed_args(module, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> PackedArgs:
    """Validate a packed attention call; raise ``AttentionBackendError`` rather than attend across examples."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise AttentionBackendError(
            "packed attention was called without cu_seq_lens_q: the example boundaries did not reach the "
            "attention function, so it cannot keep examples apart (refusing to attend across them)"
        )
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
        raise AttentionBackendError("cu_seq_lens_k differs from cu_seq_lens_q; packed self-attention needs both equal")
    if query.shape[0] != 1:
        raise AttentionBackendError(f"packed attention expects one flat row, got batch size {query.shape[0]}")
    if key.shape[2] != query.shape[2]:
        raise AttentionBackendError("packed attention got keys of another length than queries (a KV cache?)")
    if getattr(module, "is_causal", True) is False:
        raise AttentionBackendError(f"{type(module).__name__} is not causal; packed backends are causal only")
    layout = PackedLayout.of(cu)
    if layout.total != query.shape[2]:
        raise AttentionBackendError(f"cu_seqlens ends at {layout.total} but the row holds {query.shape[2]} tokens")
    window = kwargs.get("sliding_window")
    window = int(window) if window is not None and int(window) > 0 else None
    max_len = kwargs.get("max_length_q") or layout.max_len
    return PackedArgs(cu, int(max_len), window)


@dataclass
class RowPlan:
    """Examples laid out as a ``[B, L]`` rectangle of flat token indices (right-padded)."""

    index: torch.Tensor
    """``[B, L]`` long: flat position of each slot (pads point at position 0; their results are dropped)."""
    valid: torch.Tensor
    """``[B, L]`` bool: the slot holds a real token."""
    doc: torch.Tensor
    """``[B, L]`` long: example id of each slot (a distinct negative id for every pad)."""
    pos: torch.Tensor
    """``[B, L]`` long: position of the slot's token inside its example."""
    identity: bool = False
    """One row holding every token in order: no gather needed."""


@dataclass
class PackedLayout:
    """Host-side facts about one ``cu_seqlens`` tensor, cached for the layers of one forward."""

    lengths: list[int]
    total: int
    max_len: int
    _plans: dict = field(default_factory=dict)

    # (cu tensor, layout, its version): one slot is enough, every layer of a forward passes the same tensor.
    _last: ClassVar[tuple | None] = None

    @classmethod
    def of(cls, cu: torch.Tensor) -> "PackedLayout":
        last = cls._last
        if last is not None and last[0] is cu and last[2] == cu._version:
            return last[1]
        bounds = cu.tolist()  # one host sync per forward, not per layer
        lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        if bounds[0] != 0 or any(n < 0 for n in lengths):
            raise AttentionBackendError(f"cu_seqlens must start at 0 and not decrease, got {bounds[:8]}...")
        layout = cls(lengths, bounds[-1], max(lengths, default=0))
        cls._last = (cu, layout, cu._version)
        return layout

    def plan(self, key: str, groups: list[list[int]], device: torch.device) -> RowPlan:
        """Rows made of consecutive-in-row groups of examples (``groups`` lists example ids per row)."""
        if key not in self._plans:
            starts = [0]
            for n in self.lengths:
                starts.append(starts[-1] + n)
            width = max(sum(self.lengths[i] for i in g) for g in groups)
            index = torch.zeros(len(groups), width, dtype=torch.long)
            valid = torch.zeros(len(groups), width, dtype=torch.bool)
            doc = -1 - torch.arange(len(groups) * width).view(len(groups), width)
            pos = torch.zeros(len(groups), width, dtype=torch.long)
            for row, g in enumerate(groups):
                col = 0
                for i in g:
                    n = self.lengths[i]
                    index[row, col : col + n] = torch.arange(starts[i], starts[i] + n)
                    valid[row, col : col + n] = True
                    doc[row, col : col + n] = i
                    pos[row, col : col + n] = torch.arange(n)
                    col += n
            identity = len(groups) == 1 and bool(valid.all()) and width == self.total
            tensors = (t.to(device, non_blocking=True) for t in (index, valid, doc, pos))
            self._plans[key] = RowPlan(*tensors, identity=identity)
        return self._plans[key]


def allowed(doc_q, pos_q, doc_k, pos_k, window: int | None):
    """The document-causal (and sliding-window) rule, broadcast over whatever shapes are given."""
    ok = (doc_q == doc_k) & (pos_k <= pos_q)
    if window is not None:
        ok = ok & (pos_q - pos_k < window)
    return ok


def causal_window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """``[L, L]`` bool mask of one example with a sliding window, or None when plain causal suffices."""
    if window is None or length <= window:
        return None
    i = torch.arange(length, device=device)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)


def document_causal_mask(cu_seqlens: torch.Tensor, device: torch.device, window: int | None = None) -> torch.Tensor:
    """Boolean ``[T, T]`` mask: query t may attend key s iff same example, s <= t (and within the window)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=device, dtype=torch.long)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    starts = torch.repeat_interleave(cu_seqlens[:-1].to(device=device, dtype=torch.long), lengths)
    pos = torch.arange(int(cu_seqlens[-1]), device=device) - starts
    return allowed(doc[:, None], pos[:, None], doc[None, :], pos[None, :], window)
