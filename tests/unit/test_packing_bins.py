"""``Bins`` (bins as slices of one table) and the plan built on it: the same bins as a list of arrays."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.config import PackingConfig
from trainer.data.synthetic import dailydialog_like_lengths
from trainer.packing import build_sampler
from trainer.packing.balance import deal_grid, deal_order, even_out_bins
from trainer.packing.bins import Bins


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_bins_round_trip_take_and_sums():
    listed = [np.array([3, 1]), np.zeros(0, np.int64), np.array([0]), np.array([2, 4, 5])]
    bins = Bins.of(listed)
    assert Bins.of(bins) is bins and _same(list(bins), listed) and _same([bins[i] for i in range(4)], listed)
    assert bins.counts.tolist() == [2, 0, 1, 3] and not bins.pieces
    assert _same(list(bins.take(np.array([3, 0, 3]))), [listed[3], listed[0], listed[3]])
    assert _same(list(bins[1:3]), listed[1:3])
    assert bins.segment_sums(np.array([10, 20, 30, 1, 2, 3])).tolist() == [30, 0, 30, 6]
    pieces = Bins.of([np.array([[0, 0, 4]]), np.array([[1, 3, 7], [2, 0, 1]])])
    assert pieces.pieces and pieces[1].shape == (2, 3)
    assert Bins.of([]).counts.tolist() == []


@pytest.mark.parametrize("pieces", [False, True])
def test_even_out_splits_heaviest_and_fills_with_the_right_shape(pieces):
    lengths = np.array([50, 40, 30, 20, 10, 5], dtype=np.int64)
    whole = [np.array([0, 3, 5]), np.array([1, 2, 4])]
    listed = [np.stack([b, np.zeros_like(b), lengths[b]], 1) for b in whole] if pieces else whole
    out, splits, fillers = even_out_bins(listed, 3, lengths)
    assert (splits, fillers, len(out)) == (1, 0, 3)
    firsts = [b[:, 0] if pieces else b for b in out]
    assert [x.tolist() for x in firsts] == [[0, 3, 5], [1, 4], [2]]  # the heaviest split, alternating by length
    out, splits, fillers = even_out_bins(listed, 8, lengths)
    assert (splits, fillers, len(out)) == (2, 4, 8)
    assert out[-1].shape == ((0, 3) if pieces else (0,)) and out[-1].dtype == np.int64


def test_deal_grid_is_deal_order_padded():
    weights = np.array([4, 9, 1, 7, 7, 3, 8])
    grid = deal_grid(weights, 3, None)
    assert grid.tolist() == [[1, 6, 3], [5, 0, 4], [2, -1, -1]]  # a short round padded with -1
    assert [[i for i in row if i >= 0] for row in grid.tolist()] == deal_order(weights, 3, None)
    assert deal_grid(weights[:5], 3, None).tolist() == [[1, 3, 4], [-1, 2, 0]]  # odd rounds reversed


@pytest.mark.parametrize("strategy", ["bfd", "wrapped", "sorted"])
def test_plan_keeps_bins_flat_and_serves_them_in_order(strategy):
    lengths = dailydialog_like_lengths(400, seed=4)
    sampler = build_sampler(lengths, PackingConfig(balance="tokens", strategy=strategy, token_budget=512), 1, 3, seed=2)
    plan = sampler.plan(0)
    assert isinstance(plan.bins, Bins) and plan.order.shape == (plan.microbatches_per_rank, 3)
    served = [sampler.next_microbatch()[1] for _ in range(plan.microbatches_per_rank)]
    assert _same(served, [rnd[1] for rnd in plan.rounds])
