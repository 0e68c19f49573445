"""The vectorised bin weights and deal: the same numbers and order as one bin at a time."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.packing.balance import bin_weight, bin_weights, deal_bins, deal_order


@pytest.mark.parametrize("balance", ["tokens", "attention"])
def test_bin_weights_equal_bin_weight_of_each(balance):
    lengths = np.array([5, 1, 7, 3, 2, 9], dtype=np.int64)
    whole = [np.array([0, 2]), np.zeros(0, np.int64), np.array([5]), np.array([1, 3, 4]), np.zeros(0, np.int64)]
    pieces = [np.array([[0, 0, 4], [2, 3, 7]]), np.zeros((0, 3), np.int64), np.array([[5, 2, 9]])]
    for bins in (whole, pieces, [], [np.zeros(0, np.int64)]):
        assert bin_weights(bins, lengths, balance).tolist() == [bin_weight(b, lengths, balance) for b in bins]


def test_deal_is_a_snake_over_weights_then_shuffled_by_rounds():
    weights = np.array([4, 9, 1, 7, 7, 3, 8])
    assert deal_order(weights, 3, None) == [[1, 6, 3], [5, 0, 4], [2]]  # heaviest first, odd rounds reversed
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    shuffled = deal_order(weights, 3, rng_a)
    assert sorted(shuffled) == sorted(deal_order(weights, 3, None))
    assert shuffled == [deal_order(weights, 3, None)[i] for i in rng_b.permutation(3)]
    lengths = np.array([4, 9, 1, 7, 7, 3, 8])
    bins = [np.array([i]) for i in range(7)]
    assert [[int(b[0]) for b in rnd] for rnd in deal_bins(bins, 3, lengths, None)] == [[1, 6, 3], [5, 0, 4], [2]]
