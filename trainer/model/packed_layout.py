"""What every packed attention backend needs from transformers' kwargs, computed once per forward.

A packed row ``[1, heads, T, head_dim]`` holds examples back to back; ``cu_seqlens`` (``cu_seq_lens_q`` in
transformers' kwargs) gives their boundaries. ``packed_attention_kwargs`` checks them on the host once per
forward, before the decoder blocks, and returns the kwargs the model hands down to every layer's attention:
the boundaries and the longest example as a plain ``int``. ``packed_args`` checks each attention call and
returns the boundaries, the longest example and the sliding window (Mistral, Qwen sliding layers).
``PackedLayout`` derives, once per ``cu_seqlens`` tensor (every layer of one forward sees the same tensor
object), the host-side lengths and the gather plans that let the SDPA backends run a few batched calls
instead of one per example.

Compiled blocks (``parallel.compile=true``): inside a block nothing reads ``cu_seqlens`` on the host. A
host read there is a graph break, and the Python values it yields (the number of examples, the layout
cache) become guards that recompile the block for every new pack. So the host work happens once per
forward in ``packed_attention_kwargs`` (outside the compiled blocks), ``cu_seqlens``' length is marked
dynamic, and the kernel backends see only tensors and a symbolic ``max_seqlen``.

Sliding window, as transformers defines it: query ``t`` may attend key ``s`` iff ``t - W < s <= t``
(the last ``W`` tokens, itself included), and the window never leaves the example.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import ClassVar

import torch

from trainer.errors import AttentionBackendError


@dataclass(frozen=True)
class PackedArgs:
    cu_seqlens: torch.Tensor
    """int32 offsets of the examples in the row, length ``num_examples + 1``."""
    max_seqlen: int
    """The longest example: a Python int, symbolic inside a compiled block (never read back from a tensor)."""
    window: int | None
    """Sliding window in tokens (``None``: full causal attention)."""


def packed_attention_kwargs(cu_seqlens: torch.Tensor, num_tokens: int) -> dict:
    """The boundary kwargs of a packed forward (``cu_seq_lens_q/k``, ``max_length_q/k``), checked on the host
    once, outside the compiled blocks (see the module doc); transformers passes them down to every layer."""
    layout = check_boundaries(cu_seqlens, cu_seqlens, num_tokens)
    # Packs differ in their number of examples: a new length of cu_seqlens must not recompile a block.
    torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
    return {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": layout.max_len,
        "max_length_k": layout.max_len,
    }


def check_boundaries(cu: torch.Tensor, cu_k: torch.Tensor | None, num_tokens: int) -> PackedLayout:
    """The layout of ``cu``; raise ``AttentionBackendError`` unless it splits ``num_tokens`` tokens into
    examples and ``cu_k`` (keys) is the same split."""
    if cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
        raise AttentionBackendError("cu_seq_lens_k differs from cu_seq_lens_q; packed self-attention needs both equal")
    layout = PackedLayout.of(cu)
    if layout.total != num_tokens:
        raise AttentionBackendError(f"cu_seqlens ends at {layout.total} but the row holds {num_tokens} tokens")
    return layout


def packed_args(module, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> PackedArgs:
    """Validate a packed attention call; raise ``AttentionBackendError`` rather than attend across examples.

    Inside a compiled block the host-side checks are skipped: ``packed_attention_kwargs`` made them once for
    this forward (see the module doc)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise AttentionBackendError(
            "packed attention was called without cu_seq_lens_q: the example boundaries did not reach the "
            "attention function, so it cannot keep examples apart (refusing to attend across them)"
        )
    if query.shape[0] != 1:
        raise AttentionBackendError(f"packed attention expects one flat row, got batch size {query.shape[0]}")
    if key.shape[2] != query.shape[2]:
        raise AttentionBackendError("packed attention got keys of another length than queries (a KV cache?)")
    if getattr(module, "is_causal", True) is False:
        raise AttentionBackendError(f"{type(module).__name__} is not causal; packed backends are causal only")
    max_len = kwargs.get("max_length_q")
    if not torch.compiler.is_compiling():
        layout = check_boundaries(cu, kwargs.get("cu_seq_lens_k"), query.shape[2])
        max_len = max_len or layout.max_len
    elif max_len is None:
        raise AttentionBackendError("a compiled block got no max_length_q; pass packed_attention_kwargs' kwargs")
    window = kwargs.get("sliding_window")
    window = int(window) if window is not None and int(window) > 0 else None
    return PackedArgs(cu, max_len, window)


class _SlotGather(torch.autograd.Function):
    """``src.index_select(dim, index)`` along the token dimension ``dim``, where ``index`` puts every token in
    a slot (pads: token 0) or every slot back on its token, and ``inverse`` maps back. Backward is another
    gather (``grad.index_select(dim, inverse)``, slots outside ``keep`` zeroed; ``keep`` empty: all kept)
    instead of autograd's scatter-add, which on CPU costs more than the attention itself.

    Exact because every token has exactly one slot and a pad slot's gradient is zero: the pads' outputs are
    dropped (``keep`` zeroes the gradient flowing into them) and nothing real reads a pad (causal masks keep
    real queries off pad keys; a mixer's row holds one example)."""

    @staticmethod
    def forward(ctx, src, dim, index, inverse, keep):
        ctx.dim = dim
        ctx.save_for_backward(inverse, keep)
        return src.index_select(dim, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        inverse, keep = ctx.saved_tensors
        out = grad.index_select(ctx.dim, inverse)
        if keep.numel():
            out = out * keep.view(-1, *([1] * (out.dim() - ctx.dim - 1)))
        return out, None, None, None, None


@dataclass
class SlotPlan:
    """Examples laid out as right-padded rectangles stacked in one flat buffer of slots.

    Rectangle ``r`` has ``shapes[r] = (rows, width)``; each row holds whole examples. One gather fills every
    rectangle at once (``to_rectangles``) and one brings the results back (``from_rectangles``), their
    backwards single gathers too, whatever the number of rectangles.
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

    def to_rectangles(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (``[T, ...]``, tokens first) cut into the rectangles: ``[rows, width, ...]`` each, views of
        one gather."""
        slots = _SlotGather.apply(flat, 0, self.index, self.token_slot, self.index.new_empty(0, dtype=torch.bool))
        # torch.split, not slicing: its backward is one cat, where each slice's would be a full-size zeros + add;
        # and no split at all for a single rectangle (its backward would still copy the whole gradient).
        sizes = [rows * width for rows, width in self.shapes]
        parts = torch.split(slots, sizes) if len(sizes) > 1 else (slots,)
        return [p.view(rows, width, *p.shape[1:]) for p, (rows, width) in zip(parts, self.shapes, strict=True)]

    def from_rectangles(self, outs: list[torch.Tensor], row: bool = True) -> torch.Tensor:
        """The rectangles' outputs (``[rows, width, ...]`` each) back in token order: ``[1, T, ...]`` (``row``)
        or ``[T, ...]``, never a view (the gather is the last op)."""
        flat = [o.reshape(o.shape[0] * o.shape[1], *o.shape[2:]) for o in outs]
        slots = torch.cat(flat) if len(flat) > 1 else flat[0]
        if row:
            return _SlotGather.apply(slots.unsqueeze(0), 1, self.token_slot, self.index, self.valid)
        return _SlotGather.apply(slots, 0, self.token_slot, self.index, self.valid)


@dataclass
class PackedLayout:
    """Host-side facts about one ``cu_seqlens`` tensor, cached for the layers of one forward."""

    lengths: list[int]
    total: int
    max_len: int
    _cache: dict = field(default_factory=dict)
    """What ``cached`` made for this layout (plans, masks, boundaries), by key."""

    # (cu tensor, layout, its version), newest last: every layer of a forward passes the same tensor, or one
    # of a few (the example boundaries, a chunked layer's finer ones: ``trainer.model.layer_relay``).
    _recent: ClassVar[list[tuple]] = []
    RECENT: ClassVar[int] = 2

    @classmethod
    def of(cls, cu: torch.Tensor) -> PackedLayout:
        for seen, layout, version in cls._recent:
            if seen is cu and version == cu._version:
                return layout
        bounds = cu.tolist()  # one host sync per forward, not per layer
        lengths = [e - s for s, e in pairwise(bounds)]
        if bounds[0] != 0 or any(n < 0 for n in lengths):
            raise AttentionBackendError(f"cu_seqlens must start at 0 and not decrease, got {bounds[:8]}...")
        layout = cls(lengths, bounds[-1], max(lengths, default=0))
        cls._recent = [*cls._recent[1 - cls.RECENT :], (cu, layout, cu._version)]
        return layout

    def cached(self, key: str, make):
        """``make()``, made once per ``key`` and kept with this layout, which every layer of a forward shares."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def plan(self, key: str, rectangles: list[list[list[int]]], device: torch.device) -> SlotPlan:
        """Slots for ``rectangles``: each a list of rows, each row a list of example ids (cached by key)."""
        return self.cached(key, lambda: self._make_plan(rectangles, device))

    def _make_plan(self, rectangles: list[list[list[int]]], device: torch.device) -> SlotPlan:
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
        return SlotPlan(
            *(t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in tensors),
            identity=identity,
        )


def length_buckets(lengths: list[int], call_pairs: float) -> list[list[int]]:
    """Example ids grouped by similar length (longest first); every bucket becomes one batched call.

    Walking down the sorted lengths, an example joins the current bucket (padded to its longest, ``top``)
    unless the bucket's padding waste, ``sum(top^2 - l^2)`` pairs, would exceed the cost of another call
    (``call_pairs``). With ``call_pairs=0`` a bucket holds only examples of one length.
    """
    buckets, top, waste = [], 0, 0.0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if n == 0:
            continue
        extra = top * top - n * n
        if not buckets or waste + extra > call_pairs:
            buckets.append([])
            top, waste, extra = n, 0.0, 0
        buckets[-1].append(i)
        waste += extra
    return buckets


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
