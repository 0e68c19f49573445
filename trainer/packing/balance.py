"""Dealing bins to data-parallel ranks: equal micro-batch counts by construction, balanced work per step.

1. ``even_out_bins``: make the bin count a multiple of the world size. The largest multi-item bins are
   split in two (items alternate by length, so the halves hold similar tokens; nothing lost or repeated).
   Only when nothing can be split is a rank given an *empty* micro-batch (a forward/backward with no label
   token). Both are counted and logged by the sampler; data is never dropped or duplicated to even up.
2. ``deal_bins``: bins are sorted by weight (tokens, or attention cost = sum of squared item lengths) and
   cut into rounds of ``world_size`` neighbours, so the micro-batches that run side by side hold about the
   same work; the rounds are then shuffled (when asked) and rank ``r`` takes the ``r``-th bin of each round.
3. ``rank_balance``: the max/mean skew of per-rank work per optimizer step, the figure to watch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from trainer.packing.strategies import item_lengths

WORK_MEASURES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "tokens": lambda sizes: sizes,
    "attention": lambda sizes: sizes * sizes,
}
"""What ranks can be balanced on (``packing.balance``): the work of each item of a bin from its length
(a bin's work is the sum over its items)."""


def bin_weight(bin_: np.ndarray, lengths: np.ndarray, balance: str = "tokens") -> int:
    """Work in a bin: its tokens, or its attention cost (sum of squared item lengths)."""
    return int(WORK_MEASURES[balance](item_lengths(bin_, lengths)).sum())


def bin_weights(bins: list[np.ndarray], lengths: np.ndarray, balance: str = "tokens") -> np.ndarray:
    """``bin_weight`` of every bin, in one numpy pass (a plan over 1M examples has ~100k bins)."""
    out = np.zeros(len(bins), dtype=np.int64)
    counts = np.fromiter(map(len, bins), dtype=np.int64, count=len(bins))
    if not counts.sum():
        return out
    work = WORK_MEASURES[balance](item_lengths(np.concatenate(bins), lengths))
    filled = counts > 0  # an empty bin has no item between its neighbours' starts
    out[filled] = np.add.reduceat(work, (np.cumsum(counts) - counts)[filled])
    return out


def even_out_bins(
    bins: list[np.ndarray], world_size: int, lengths: np.ndarray, balance: str = "tokens"
) -> tuple[list[np.ndarray], int, int]:
    """Make ``len(bins)`` a multiple of ``world_size``: split the heaviest splittable bins, then add empty
    filler bins. Returns (bins, number split, number of fillers)."""
    need = -len(bins) % world_size
    if need == 0:
        return bins, 0, 0
    bins = list(bins)
    splittable = np.flatnonzero(np.fromiter(map(len, bins), dtype=np.int64, count=len(bins)) >= 2)
    heaviest_first = np.argsort(-bin_weights([bins[i] for i in splittable], lengths, balance), kind="stable")
    splits = 0
    for i in splittable[heaviest_first[:need]].tolist():
        b = bins[i][np.argsort(-item_lengths(bins[i], lengths), kind="stable")]
        bins[i], extra = b[0::2], b[1::2]
        bins.append(extra)
        splits += 1
    fillers = need - splits
    empty = np.zeros((0, 3) if bins and bins[0].ndim == 2 else 0, dtype=np.int64)
    bins += [empty] * fillers
    return bins, splits, fillers


def deal_bins(
    bins: list[np.ndarray], world_size: int, lengths: np.ndarray, rng: np.random.Generator | None,
    balance: str = "tokens",
) -> list[list[np.ndarray]]:
    """Rounds of ``world_size`` bins of similar weight (snake order), shuffled when ``rng`` is given."""
    order = deal_order(bin_weights(bins, lengths, balance), world_size, rng)
    return [list(map(bins.__getitem__, row)) for row in order]


def deal_order(weights: np.ndarray, world_size: int, rng: np.random.Generator | None) -> list[list[int]]:
    """``deal_bins`` as bin indices: ``rounds[k][r]`` is the bin of rank r in round k."""
    order = np.argsort(-np.asarray(weights), kind="stable")
    full = len(order) - len(order) % world_size
    grid = order[:full].reshape(-1, world_size)
    grid[1::2] = grid[1::2, ::-1].copy()  # snake: the heaviest bin goes to rank 0, then to the last rank
    rounds = grid.tolist()
    if full < len(order):
        tail = order[full:].tolist()
        rounds.append(tail if len(rounds) % 2 == 0 else tail[::-1])
    if rng is not None:
        rounds = [rounds[i] for i in rng.permutation(len(rounds))]
    return rounds


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
