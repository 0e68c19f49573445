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
class SlotPlan:
    """Examples laid out as right-padded rectangles stacked in one flat buffer of slots.

    Rectangle ``r`` has ``shapes[r] = (rows, width)``; each row holds whole examples. One ``index_select``
    fills every rectangle at once and one brings the results back (their backwards are single
    ``index_add`` calls), whatever the number of rectangles.
    """

    index: torch.Tensor
    """``[slots]`` long: the token each slot holds (pads point at token 0; their results are dropped)."""
    token_slot: torch.Tensor
    """``[T]`` long: the slot each token went to."""
    shapes: list[tuple[int, int]]
    doc: torch.Tensor
    """``[slots]`` long: example id per slot (a distinct negative id for every pad)."""
    pos: torch.Tensor
    """``[slots]`` long: position of the slot's token inside its example."""
    valid: torch.Tensor
    """``[slots]`` bool: the slot holds a real token."""
    identity: bool = False
    """One rectangle of one row holding every token in order: no gather needed."""


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

    def plan(self, key: str, rectangles: list[list[list[int]]], device: torch.device) -> SlotPlan:
        """Slots for ``rectangles``: each a list of rows, each row a list of example ids (cached by key)."""
        if key not in self._plans:
            starts = [0]
            for n in self.lengths:
                starts.append(starts[-1] + n)
            index, doc, pos, shapes = [], [], [], []
            token_slot = torch.empty(self.total, dtype=torch.long)
            for rows in rectangles:
                width = max(sum(self.lengths[i] for i in row) for row in rows)
                shapes.append((len(rows), width))
                for row in rows:
                    used = 0
                    for i in row:
                        n = self.lengths[i]
                        token_slot[starts[i] : starts[i] + n] = torch.arange(len(index), len(index) + n)
                        index += range(starts[i], starts[i] + n)
                        doc += [i] * n
                        pos += range(n)
                        used += n
                    pads = width - used
                    index += [0] * pads
                    doc += range(-len(doc) - 1, -len(doc) - 1 - pads, -1)
                    pos += [0] * pads
            identity = shapes == [(1, self.total)] and index == list(range(self.total))
            doc_t = torch.tensor(doc)
            tensors = (torch.tensor(index), token_slot, shapes, doc_t, torch.tensor(pos), doc_t >= 0)
            self._plans[key] = SlotPlan(
                *(t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in tensors),
                identity=identity,
            )
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

