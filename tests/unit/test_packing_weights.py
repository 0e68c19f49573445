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


def pairs_and_sequences():
    """The preference pairs of ``test_dpo`` (in memory) and each pair's two sequence lengths."""
    from tests.unit.test_dpo import pair_dataset

    ds = pair_dataset(shapes=[(5, 9, 3), (1, 14, 6), (7, 2, 11), (3, 8, 8), (10, 4, 1), (2, 30, 2), (6, 1, 1)])
    return ds, np.array([[len(c[0]), len(r[0])] for c, r in map(ds.pair, range(len(ds)))])


def test_a_pair_weighs_its_two_sequences_and_enters_the_fingerprint():
    """Under every balance a pair's work is measure(a) + measure(b) of its two sequences (attention: a^2 + b^2,
    not (a + b)^2), in the bin weights and in the sampler's deal; a checkpoint dealt before (a pair costed as
    one sequence of its total length) is refused where that changes the plan, and resumes under tokens."""
    from trainer.config import PackingConfig
    from trainer.packing import MicroBatchSampler, TokenCost, work_measure

    ds, seqs = pairs_and_sequences()
    lengths, splits = ds.lengths, ds.pair_splits
    assert (seqs.sum(axis=1) == lengths).all() and (splits == seqs[:, 0]).all()
    cost = TokenCost(per_token=3.0, per_pair=0.5)
    bins = [np.array([0, 1]), np.array([2, 3, 4]), np.array([5]), np.array([6])]
    for balance in ("tokens", "attention", "flops"):
        measure = work_measure(balance, cost)
        per_pair = measure(seqs[:, 0]) + measure(seqs[:, 1])
        assert bin_weights(bins, lengths, measure, splits).tolist() == pytest.approx([per_pair[b].sum() for b in bins])
        assert [bin_weight(b, lengths, measure, splits) for b in bins] == [int(per_pair[b].sum()) for b in bins]
    assert (
        bin_weights(bins, lengths, "attention", splits)[2] == 32**2 + 4**2 != bin_weights(bins, lengths, "attention")[2]
    )

    def sampler(balance, pair_splits, world=2):
        cfg = PackingConfig(strategy="bfd", token_budget=64, balance=balance)
        return MicroBatchSampler(lengths, cfg, 0, world, seed=0, cost=cost, pair_splits=pair_splits)

    plan = sampler("attention", splits).plan(0)
    per_pair = seqs[:, 0] ** 2 + seqs[:, 1] ** 2
    assert plan.work.tolist() == [
        [per_pair[plan.microbatch(k, r)].sum() for r in range(2)] for k in range(len(plan.order))
    ]
    for balance in ("attention", "flops"):
        old = sampler(balance, None).state_dict()
        with pytest.raises(ValueError, match="different packing config"):
            sampler(balance, splits).load_state_dict(old)
    sampler("tokens", splits).load_state_dict(sampler("tokens", None).state_dict())  # the same plan either way


def test_a_pair_pads_as_two_rows_in_analyze_pack_and_the_trainers_counterfactual():
    """A padded micro-batch of pairs (``collate_padded`` via ``collate_pairs``) is one row per sequence, padded to
    the widest sequence: ``pack``'s positions, ``packfsdp analyze``'s figures and the trainer's padded
    counterfactual of a packed batch (``Batch.padded_positions``) all count what that collate builds."""
    from tests.conftest import compose_job
    from trainer.collate import collate_packed, collate_padded
    from trainer.packing import PackParams, pack
    from trainer.tools.analyze import packing_report

    ds, seqs = pairs_and_sequences()
    lengths, splits = ds.lengths, ds.pair_splits
    cfg = compose_job(
        [
            "recipe=cpu_dpo",
            "packing.balance=attention",
            "packing.token_budget=64",
            "data.max_length=64",
            "packing.padded_batch_size=3",
        ]
    )
    _, figures = packing_report(ds, cfg, [2])
    assert set(figures["strategies"]) == {"none", "sorted", "ffd", "bfd"}  # a pair is never cut into pieces
    for name in ("none", "sorted"):
        result = pack(
            lengths,
            name,
            PackParams(64, batch_size=3, oversize="drop"),
            np.random.default_rng([cfg.seed, 0, 0]),
            splits,
        )
        padded = [collate_padded(ds, b, 0) for b in result.bins]
        assert all(b.num_positions == b.input_ids.numel() for b in padded)  # rows x width
        assert (
            figures["strategies"][name]["positions"] == result.stats.positions == sum(b.num_positions for b in padded)
        )
        assert [collate_packed(ds, b).padded_positions for b in result.bins] == [b.num_positions for b in padded]
        as_whole_pairs = sum(len(b) * int(lengths[b].max()) for b in result.bins)
        assert result.stats.positions != as_whole_pairs  # what analyze reported before
    assert figures["max_speedup"] == figures["strategies"]["none"]["positions"] / lengths.sum()
