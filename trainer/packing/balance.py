"""Dealing bins to data-parallel ranks: equal micro-batch counts by construction, balanced work per step.

1. ``even_out_bins``: make the bin count a multiple of the world size. The largest multi-item bins are
   split in two (items alternate by length, so the halves hold similar tokens; nothing lost or repeated).
   Only when nothing can be split is a rank given an *empty* micro-batch (a forward/backward with no label
   token). Both are counted and logged by the sampler; data is never dropped or duplicated to even up.
2. ``deal_bins``: bins are sorted by weight (``packing.balance``: tokens, attention cost = sum of squared item
   lengths, or model FLOPs = both terms weighed as the model's own FLOPs weigh them, ``TokenCost``; a preference
   pair weighs what its two sequences weigh, ``item_work``) and cut into rounds of ``world_size`` neighbours, so the
   micro-batches that run side by side hold about the same work; the rounds are then shuffled (when asked) and rank
   ``r`` takes the ``r``-th bin of each round.
3. ``rank_balance``: the max/mean skew of per-rank work per optimizer step, the figure to watch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from trainer.config.common import WORK_MEASURES
from trainer.packing.bins import Bins
from trainer.packing.strategies import item_lengths, item_sequences


@dataclass(frozen=True)
class TokenCost:
    """Model FLOPs of one example of ``n`` tokens: ``per_token * n + per_pair * n**2`` (the matmul
    parameters' linear cost and causal attention's quadratic one; ``trainer.throughput.token_cost`` derives
    both from the model, and ``model_flops`` counts a step's FLOPs with the same two numbers)."""

    per_token: float
    per_pair: float

    def of(self, sizes: np.ndarray) -> np.ndarray:
        sizes = np.asarray(sizes, dtype=np.float64)
        return self.per_token * sizes + self.per_pair * sizes * sizes


Measure = Callable[[np.ndarray], np.ndarray]


def work_measure(balance: str | Measure, cost: TokenCost | None = None) -> Measure:
    """``item lengths -> work`` for a ``packing.balance`` name (``WORK_MEASURES``; a callable is returned as is):
    a bin's work is the sum over its items' sequences (``item_work``), and every measure gives 0 work to a
    sequence of 0 tokens. ``flops`` needs the model's ``TokenCost``."""
    if callable(balance):
        return balance
    if balance == "tokens":
        return lambda sizes: sizes
    if balance == "attention":
        return lambda sizes: sizes * sizes
    if balance == "flops":
        if cost is None:
            raise ValueError(
                "packfsdp: packing.balance=flops needs the model's FLOP sizes (a TokenCost); "
                "pass cost= or choose packing.balance=tokens"
            )
        return cost.of
    raise ValueError(f"packfsdp: packing.balance={balance!r}; choose one of {', '.join(WORK_MEASURES)}")


def item_work(
    items: np.ndarray, lengths: np.ndarray, balance: str | Measure = "tokens", pair_splits: np.ndarray | None = None
) -> np.ndarray:
    """Work of every item (example, piece, or preference pair) of a bin: the measure of each of its
    sequences, summed. A pair runs as two sequences (``pair_splits``, ``item_sequences``), so its attention
    term is ``a^2 + b^2``, not ``(a + b)^2``; any other item is one sequence (the other is 0 tokens)."""
    measure = work_measure(balance)
    if pair_splits is None:
        return measure(item_lengths(items, lengths))
    sequences = item_sequences(items, lengths, pair_splits)
    return measure(sequences[:, 0]) + measure(sequences[:, 1])


def bin_weight(
    bin_: np.ndarray, lengths: np.ndarray, balance: str | Measure = "tokens", pair_splits: np.ndarray | None = None
) -> int:
    """Work in a bin (``item_work``): its tokens, its attention cost (sum of squared sequence lengths), ..."""
    return int(item_work(bin_, lengths, balance, pair_splits).sum())


def bin_weights(
    bins: Sequence[np.ndarray],
    lengths: np.ndarray,
    balance: str | Measure = "tokens",
    pair_splits: np.ndarray | None = None,
) -> np.ndarray:
    """``bin_weight`` of every bin, in one numpy pass (a plan over 1M examples has ~100k bins)."""
    bins = Bins.of(bins)
    return bins.segment_sums(item_work(bins.items, lengths, balance, pair_splits))


def even_out_bins(
    bins: Sequence[np.ndarray],
    world_size: int,
    lengths: np.ndarray,
    balance: str | Measure = "tokens",
    pair_splits: np.ndarray | None = None,
) -> tuple[Bins, int, int]:
    """Make ``len(bins)`` a multiple of ``world_size``: split the heaviest splittable bins, then add empty
    filler bins. Returns (bins, number split, number of fillers)."""
    bins = Bins.of(bins)
    need = -len(bins) % world_size
    if need == 0:
        return bins, 0, 0
    splittable = np.flatnonzero(bins.counts >= 2)
    heaviest_first = np.argsort(-bin_weights(bins.take(splittable), lengths, balance, pair_splits), kind="stable")
    items, ends = bins.items.copy(), bins.ends.copy()  # a split bin is rewritten in place: its two halves
    halves: list[int] = []
    for i in splittable[heaviest_first[:need]].tolist():
        lo, hi = int(bins.starts[i]), int(bins.ends[i])
        b = items[lo:hi][np.argsort(-item_lengths(items[lo:hi], lengths), kind="stable")]
        items[lo:hi] = np.concatenate([b[0::2], b[1::2]])  # items alternate by length between the halves
        ends[i] = lo + len(b[0::2])
        halves.append(i)
    splits, fillers = len(halves), need - len(halves)
    new_starts = np.concatenate([ends[halves], np.zeros(fillers, dtype=np.int64)])  # a filler is empty
    new_ends = np.concatenate([bins.ends[halves], np.zeros(fillers, dtype=np.int64)])
    return Bins(items, np.concatenate([bins.starts, new_starts]), np.concatenate([ends, new_ends])), splits, fillers


def deal_bins(
    bins: Sequence[np.ndarray],
    world_size: int,
    lengths: np.ndarray,
    rng: np.random.Generator | None,
    balance: str | Measure = "tokens",
    pair_splits: np.ndarray | None = None,
) -> list[list[np.ndarray]]:
    """Rounds of ``world_size`` bins of similar weight (snake order), shuffled when ``rng`` is given."""
    order = deal_order(bin_weights(bins, lengths, balance, pair_splits), world_size, rng)
    return [list(map(bins.__getitem__, row)) for row in order]


def deal_grid(weights: np.ndarray, world_size: int, rng: np.random.Generator | None) -> np.ndarray:
    """``deal_order`` as a ``(rounds, world_size)`` array; a short last round is padded with ``-1``."""
    order = np.argsort(-np.asarray(weights), kind="stable")
    grid = np.full(-(-len(order) // world_size) * world_size, -1, dtype=np.int64)
    grid[: len(order)] = order
    grid = grid.reshape(-1, world_size)
    grid[1::2] = grid[1::2, ::-1].copy()  # snake: the heaviest bin goes to rank 0, then to the last rank
    return grid if rng is None else grid[rng.permutation(len(grid))]


def deal_order(weights: np.ndarray, world_size: int, rng: np.random.Generator | None) -> list[list[int]]:
    """``deal_bins`` as bin indices: ``rounds[k][r]`` is the bin of rank r in round k."""
    return [[i for i in row if i >= 0] for row in deal_grid(weights, world_size, rng).tolist()]


def rank_balance(rounds: list[list[np.ndarray]], weight, grad_accum: int = 1) -> dict[str, float]:
    """Max/mean skew of per-rank work per optimizer step (``grad_accum`` consecutive rounds).

    Args:
        rounds: an epoch plan, ``rounds[k][r]`` rank r's k-th micro-batch.
        weight: ``bin -> number`` (tokens, useful tokens, attention cost, ...).
        grad_accum: micro-batches per optimizer step.

    Returns:
        ``skew``: sum over steps of the slowest rank's work over the sum of the mean work, minus 1 (the
        share of time ranks wait, if time ~ work); ``worst_step_skew``: max over steps of max/mean - 1;
        ``epoch_skew``: max/mean - 1 of whole-epoch totals per rank.
    """
    return rank_balance_of(np.array([[weight(b) for b in rnd] for rnd in rounds], dtype=np.float64), grad_accum)


def rank_balance_of(w: np.ndarray, grad_accum: int = 1) -> dict[str, float]:
    """``rank_balance`` from the work of every micro-batch, ``w[k, r]`` (round k, rank r)."""
    if not len(w):
        return {"skew": 0.0, "worst_step_skew": 0.0, "epoch_skew": 0.0, "steps": 0}
    w = np.asarray(w, dtype=np.float64)
    steps = np.add.reduceat(w, np.arange(0, len(w), grad_accum), axis=0)
    peak, mean = steps.max(axis=1), steps.mean(axis=1)
    ok = mean > 0
    totals = w.sum(axis=0)
    return {
        "skew": float(peak.sum() / mean.sum() - 1) if mean.sum() else 0.0,
        "worst_step_skew": float((peak[ok] / mean[ok]).max() - 1) if ok.any() else 0.0,
        "epoch_skew": float(totals.max() / totals.mean() - 1) if totals.mean() else 0.0,
        "steps": int(len(steps)),
    }
