"""The two SDPA backends for packed rows (CPU and GPU, no extra dependency).

``sdpa_varlen``: exact causal attention inside each example. Examples of similar length share one
batched SDPA call: each becomes a right-padded row of a ``[B, heads, L, head_dim]`` rectangle run with
``is_causal=True``. Right padding is invisible to causal attention (a real token only sees keys at or
before itself, all real), and the pads' own outputs are dropped, so the result is the per-example SDPA
result, with a handful of calls instead of one per example.

``sdpa_block_mask``: SDPA with a block-diagonal causal mask, the textbook reference::

      a . . . . .      example a: tokens 0-2, example b: tokens 3-5
      a a . . . .      row = query, column = key, letter = may attend
      a a a . . .
      . . . b . .
      . . . b b .
      . . . b b b

A dense ``T x T`` mask costs ``T^2`` per head whatever the examples, which at budgets of thousands of
tokens is more work than the padded baseline does. So the row is cut at example boundaries into tiles
(``tile_width``: at least the longest example, chosen to minimise ``tiles * width^2``) and all tiles go
through *one* SDPA call as a batch, each with its own block-diagonal causal mask: the same mask, minus
the all-false blocks between tiles.

Attention sinks (``s_aux``): both add the sink as one more key every query of a rectangle sees
(``trainer.model.sinks.sdpa_with_sinks``), so each example keeps its own softmax denominator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.model.attention_needs import refuse_unhonoured
from trainer.model.packed_layout import PackedLayout, SlotPlan, allowed, causal_window_mask, length_buckets, packed_args
from trainer.model.sinks import sdpa_with_sinks, sinks_of

CALL_COST = 2e7
"""What one extra SDPA call costs, in (query, key) pairs times ``heads * head_dim``: the fixed overhead of
a call (dispatch, threads, autograd) measured against the per-pair work. Buckets and tiles trade padding
waste against calls with it; only the grouping changes, never the result."""


GATHER_CALLS = 4
"""The gathers into and out of tiles (forward and backward) cost about this many SDPA calls' overhead."""


def _call_cost_pairs(query: torch.Tensor) -> float:
    # On CPU the per-pair work is split over the threads while a call's fixed cost is not (each op is a
    # parallel region with its own barrier), so an extra call is worth more pairs with more threads.
    threads = torch.get_num_threads() if query.device.type == "cpu" else 1
    return CALL_COST * threads / (query.shape[1] * query.shape[3])


def _run_rects(query, key, value, plan: SlotPlan, attend) -> torch.Tensor:
    """Run ``attend(q, k, v, r)`` on every rectangle ``r`` of the plan; return ``[1, T, H, D]`` in row order.

    ``query`` is ``[1, H, T, D]``, a transposed view of transformers' ``[1, T, H, D]`` projections, so the
    gather works on the token dimension of that memory and the rectangles come out in the same layout.

    The result is never a view: under ``parallel.compile`` it enters the compiled code after attention,
    which guards on a view's base, so views of different bases would recompile it from pack to pack.
    """
    if plan.identity:
        return attend(query, key, value, 0).transpose(1, 2).contiguous()
    # squeeze, not x[0]: a select's backward writes a zero-filled copy of the whole input, a squeeze's is a view.
    parts = [plan.to_rectangles(x.squeeze(0).transpose(0, 1)) for x in (query, key, value)]  # [rows, width, H, D]
    outs = []
    for r in range(len(plan.shapes)):
        out = attend(*(p[r].transpose(1, 2) for p in parts), r)  # [rows, H, width, D]
        outs.append(out.transpose(1, 2))
    return plan.from_rectangles(outs)


def sdpa_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Exact causal SDPA per example, examples of similar length batched into one call; sinks as one more
    key (no softcapping: SDPA has none)."""
    refuse_unhonoured("sdpa_varlen", kwargs, sinks=True)
    sinks = sinks_of("sdpa_varlen", kwargs)
    args = packed_args(module, query, key, kwargs)
    layout = PackedLayout.of(args.cu_seqlens)
    gqa = query.shape[1] != key.shape[1]

    def attend(q, k, v, r):
        mask = causal_window_mask(q.shape[2], args.window, q.device)
        if sinks is not None:
            return sdpa_with_sinks(q, k, v, mask, sinks, scaling, dropout)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=gqa
        )

    if len(layout.lengths) == 1:  # one example: the row itself
        return attend(query, key, value, 0).transpose(1, 2).contiguous(), None

    # One rectangle per length bucket, one example per row.
    call_pairs = _call_cost_pairs(query)
    buckets = [[[i] for i in bucket] for bucket in length_buckets(layout.lengths, call_pairs)]
    return _run_rects(query, key, value, layout.plan(f"varlen:{call_pairs}", buckets, query.device), attend), None


def tiles(lengths: list[int], width: int) -> list[list[int]]:
    """Consecutive examples grouped into tiles of at most ``width`` tokens (each example fits one tile)."""
    groups, used = [[]], 0
    for i, n in enumerate(lengths):
        if groups[-1] and used + n > width:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


def tile_width(lengths: list[int], longest: int, call_pairs: float = 0.0) -> int:
    """The tile width (a multiple of 64, at least the longest example) with the least estimated cost:
    ``tiles * width^2`` masked pairs (all tiles share one call), plus, unless one tile is the whole row
    (no gather), the gathers' cost counted as ``GATHER_CALLS`` calls."""
    total = sum(lengths)
    candidates = {total} | {min(total, -(-longest // 64) * 64 * k) for k in (1, 2, 4, 8)}

    def cost(w: int) -> float:
        n = len(tiles(lengths, w))
        return n * w * w + (0.0 if n == 1 else GATHER_CALLS * call_pairs)

    return min(sorted(candidates), key=cost)


def sdpa_block_mask_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One SDPA call over the row's tiles, each with a block-diagonal causal mask (see the module doc); sinks
    as one more key, no softcapping."""
    refuse_unhonoured("sdpa_block_mask", kwargs, sinks=True)
    sinks = sinks_of("sdpa_block_mask", kwargs)
    args = packed_args(module, query, key, kwargs)
    layout = PackedLayout.of(args.cu_seqlens)
    width = tile_width(layout.lengths, layout.max_len, _call_cost_pairs(query))
    plan = layout.plan(f"tiles:{width}", [tiles(layout.lengths, width)], query.device)

    def tile_mask() -> torch.Tensor:
        rows, w = plan.shapes[0]
        d, p = plan.doc.view(rows, w), plan.pos.view(rows, w)
        return allowed(d[:, :, None], p[:, :, None], d[:, None, :], p[:, None, :], args.window)

    mask = layout.cached(f"tilemask:{width}:{args.window}", tile_mask).unsqueeze(1)  # [tiles, 1, S, S]

    def attend(q, k, v, r):
        if sinks is not None:
            return sdpa_with_sinks(q, k, v, mask, sinks, scaling, dropout)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
        )

    return _run_rects(query, key, value, plan, attend), None


# ------------------------------------------------------------------------------- query runs against their keys
def lower_right_mask(lq: int, lk: int, window: int | None, device) -> torch.Tensor:
    """``[lq, lk]``: the causal (sliding-window) mask of ``lq`` queries that are the LAST ``lq`` of ``lk`` keys
    (bottom-right aligned, as flash-attn aligns ``cu_seqlens_q != cu_seqlens_k``)."""
    i = torch.arange(lq, device=device)[:, None] + (lk - lq)
    j = torch.arange(lk, device=device)[None, :]
    ok = j <= i
    if window is not None:
        ok = ok & (i - j < window)
    return ok


def query_runs(cu_q: torch.Tensor, cu_k: torch.Tensor, window, device) -> list[tuple[int, int, int, int, torch.Tensor]]:
    """Each query run's ``(q_start, q_end, k_start, k_end, mask)``: ``cu_q[n]:cu_q[n + 1]`` of the queries against
    ``cu_k[n]:cu_k[n + 1]`` of the keys, the run's queries the last of its keys, causal bottom-right
    (``lower_right_mask``: SDPA's ``is_causal`` is top-left on non-square inputs). Host work: made once per
    forward by the caller (``trainer.parallel.cp_attention``), not per layer."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [
        (cq[n], cq[n + 1], ck[n], ck[n + 1], lower_right_mask(cq[n + 1] - cq[n], ck[n + 1] - ck[n], window, device))
        for n in range(len(cq) - 1)
    ]


def sdpa_query_runs(query, key, value, runs, scaling, dropout, softcap=None) -> torch.Tensor:
    """The runs (``query_runs``) of ``query`` ``[1, H, S, D]`` against their keys of ``key``/``value``
    ``[1, Hkv, K, D]`` (runs back to back). Returns ``[1, S, H, D]``. A context-parallel shard's queries against
    the row's gathered keys."""
    if softcap is not None:
        raise ValueError("packfsdp: sdpa_varlen cannot softcap attention logits under cp; use flash_attn or flex")
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, qs:qe],
            key[:, :, ks:ke],
            value[:, :, ks:ke],
            attn_mask=mask,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        for qs, qe, ks, ke, mask in runs
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()
