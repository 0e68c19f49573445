"""Sampler: every example once per epoch, budget respected, equal micro-batch counts per rank, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.config import PackingConfig
from trainer.packing import build_sampler, pack_best_fit_decreasing


def _lengths(n=500, seed=0, budget=256):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(3.5, 0.8, size=n).astype(int), 1, budget)


def _epoch(sampler, epoch):
    return [r[sampler.rank] for r in sampler.plan(epoch).rounds]


@pytest.mark.parametrize("strategy", ["bfd", "none"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_example_once_equal_counts(strategy, world):
    lengths = _lengths()
    cfg = PackingConfig(balance="tokens", strategy=strategy, token_budget=256)
    samplers = [build_sampler(lengths, cfg, r, world, seed=7) for r in range(world)]
    per_rank = [_epoch(s, 0) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1, "every rank must run the same number of micro-batches"
    seen = np.concatenate([mb for batches in per_rank for mb in batches])
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    if strategy == "bfd":
        assert all(lengths[mb].sum() <= 256 for batches in per_rank for mb in batches)


def test_uneven_bin_count_is_split_not_dropped():
    lengths = np.array([100, 100, 100, 20, 20])  # 3 bins for 2 ranks: one bin must be split
    cfg = PackingConfig(balance="tokens", strategy="bfd", token_budget=120)
    plans = [build_sampler(lengths, cfg, r, 2, seed=0).plan(0) for r in range(2)]
    assert plans[0].splits == 1 and plans[0].filler_microbatches == 0
    assert plans[0].microbatches_per_rank == plans[1].microbatches_per_rank == 2


def test_fillers_only_when_nothing_can_be_split():
    lengths = np.array([50])
    cfg = PackingConfig(balance="tokens", strategy="bfd", token_budget=64)
    plans = [build_sampler(lengths, cfg, r, 3, seed=0).plan(0) for r in range(3)]
    assert plans[0].filler_microbatches == 2
    assert sum(len(p.rounds[0][r]) for r, p in enumerate(plans)) == 1


def test_deterministic_for_a_seed_and_varies_by_epoch():
    lengths = _lengths()
    cfg = PackingConfig(balance="tokens", strategy="bfd", token_budget=256)
    a = _epoch(build_sampler(lengths, cfg, 0, 2, seed=3), 0)
    b = _epoch(build_sampler(lengths, cfg, 0, 2, seed=3), 0)
    c = _epoch(build_sampler(lengths, cfg, 0, 2, seed=3), 1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_resume_mid_epoch_continues_exactly():
    lengths = _lengths()
    cfg = PackingConfig(balance="tokens", strategy="bfd", token_budget=256)
    full = build_sampler(lengths, cfg, 1, 2, seed=5)
    expected = [full.next_microbatch()[1] for _ in range(30)]
    first = build_sampler(lengths, cfg, 1, 2, seed=5)
    for _ in range(12):
        first.next_microbatch()
    resumed = build_sampler(lengths, cfg, 1, 2, seed=5)
    resumed.load_state_dict(first.state_dict())
    rest = [resumed.next_microbatch()[1] for _ in range(18)]
    assert all(np.array_equal(x, y) for x, y in zip(expected[12:], rest, strict=True))


def test_bfd_fill_close_to_lower_bound_on_dialog_lengths(small_dataset):
    lengths = small_dataset.lengths
    bins = pack_best_fit_decreasing(lengths, 1024)
    lower_bound = int(np.ceil(lengths.sum() / 1024))
    assert len(bins) <= lower_bound + 1


def test_padded_batch_size_matches_packed_microbatch_count():
    lengths = _lengths(2000)
    packed = build_sampler(lengths, PackingConfig(balance="tokens", strategy="bfd", token_budget=512), 0, 1, seed=0)
    padded = build_sampler(lengths, PackingConfig(balance="tokens", strategy="none", token_budget=512), 0, 1, seed=0)
    n_packed, n_padded = packed.microbatches_per_rank(0), padded.microbatches_per_rank(0)
    assert abs(n_packed - n_padded) / n_packed < 0.1
