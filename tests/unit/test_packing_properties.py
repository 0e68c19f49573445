"""Property tests (hypothesis) for packing and the distributed sampler.

For random length lists, budgets, caps and world sizes 1-8, with every strategy:
- every example is used exactly once per epoch, or counted as skipped (empty) / dropped (over-long), or
  covered exactly once by its pieces (split strategies: pieces tile the example, overlapping by one token);
- no packed bin is over budget, no bin over the cap;
- every rank runs the same number of micro-batches;
- the same seed gives the same order;
- resuming mid-epoch (same world size) continues exactly like the uninterrupted run; resuming on another
  world size (once or twice) serves exactly the remaining items, none repeated, none lost.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.config import PackingConfig
from trainer.packing import STRATEGIES, MicroBatchSampler, PackParams, pack

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = sorted(STRATEGIES)

lengths_st = st.lists(st.integers(min_value=0, max_value=90), min_size=0, max_size=60)


def items(bin_: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """A bin as (example, start, end) items, whole examples included."""
    if bin_.ndim == 2:
        return [tuple(int(v) for v in row) for row in bin_]
    return [(int(i), 0, int(lengths[i])) for i in bin_]


def check_coverage(all_items: list[tuple[int, int, int]], lengths: np.ndarray, expected: set[int]) -> None:
    """Every expected example is tiled exactly once by its items; nothing else appears."""
    by_example: dict[int, list[tuple[int, int]]] = {}
    for ex, lo, hi in all_items:
        by_example.setdefault(ex, []).append((lo, hi))
    assert set(by_example) == expected
    for ex, pieces in by_example.items():
        pieces.sort()
        assert pieces[0][0] == 0 and pieces[-1][1] == lengths[ex]
        for (_, prev_end), (start, end) in pairwise(pieces):
            assert start == prev_end - 1 and end > start + 1  # one overlap token, at least one label
        assert len(set(pieces)) == len(pieces)


@SETTINGS
@given(
    lengths=lengths_st,
    strategy=st.sampled_from(NAMES),
    budget=st.integers(min_value=2, max_value=64),
    cap=st.one_of(st.none(), st.integers(min_value=1, max_value=5)),
    batch_size=st.integers(min_value=1, max_value=7),
    seed=st.integers(min_value=0, max_value=3),
)
def test_pack_uses_every_example_once_or_counts_it(lengths, strategy, budget, cap, batch_size, seed):
    lengths = np.asarray(lengths, dtype=np.int64)
    params = PackParams(budget, cap, oversize="drop", batch_size=batch_size)
    result = pack(lengths, strategy, params, np.random.default_rng(seed))
    strat, stats = STRATEGIES[strategy], result.stats
    empty = lengths == 0
    over = (lengths > budget) & ~strat.padded & ~strat.splits
    assert stats.skipped_empty == int(empty.sum())
    assert stats.dropped_oversize == int(over.sum())
    expected = set(np.flatnonzero(~empty & ~over).tolist())
    all_items = [it for b in result.bins for it in items(b, lengths)]
    check_coverage(all_items, lengths, expected)
    if not strat.splits:
        assert len(all_items) == len(expected)  # whole examples: exactly once
    for b in result.bins:
        assert len(b) >= 1
        sizes = [hi - lo for _, lo, hi in items(b, lengths)]
        if strat.padded:
            assert len(b) <= batch_size
        else:
            assert sum(sizes) <= budget
            assert cap is None or len(b) <= cap
    assert stats.bins == len(result.bins)
    if not strat.padded and stats.bins:
        assert stats.bins >= stats.lower_bound
    multi = Counter(ex for ex, _, _ in all_items)
    assert stats.split_examples == sum(1 for c in multi.values() if c > 1)


def make_samplers(lengths, cfg, world_size, seed=7, grad_accum=1):
    return [
        MicroBatchSampler(
            lengths, cfg, r, world_size, seed, padded_batch_size=3, grad_accum=grad_accum, oversize="drop"
        )
        for r in range(world_size)
    ]


def take(samplers, n):
    """n micro-batches from every rank; returns per-round lists of bins and checks ranks agree on epochs."""
    rounds = []
    for _ in range(n):
        outs = [s.next_microbatch() for s in samplers]
        assert len({(e, last) for e, _, last in outs}) == 1  # every rank in the same epoch and step
        rounds.append([b for _, b, _ in outs])
    return rounds


def flat_items(rounds, lengths):
    return [it for rnd in rounds for b in rnd for it in items(b, lengths)]


config_st = st.builds(
    lambda strategy, budget, cap, shuffle, balance: PackingConfig(
        strategy=strategy,
        token_budget=budget,
        max_examples_per_bin=cap,
        shuffle=shuffle,
        balance=balance,
    ),
    strategy=st.sampled_from(NAMES),
    budget=st.integers(min_value=2, max_value=64),
    cap=st.one_of(st.none(), st.integers(min_value=1, max_value=4)),
    shuffle=st.booleans(),
    balance=st.sampled_from(["tokens", "attention"]),
)


@SETTINGS
@given(lengths=lengths_st, cfg=config_st, world_size=st.integers(min_value=1, max_value=8))
def test_sampler_equal_steps_same_seed_same_order(lengths, cfg, world_size):
    lengths = np.asarray(lengths, dtype=np.int64)
    samplers = make_samplers(lengths, cfg, world_size)
    per_rank = {s.microbatches_per_rank(0) for s in samplers}
    assert len(per_rank) == 1
    n = per_rank.pop()
    epoch = take(samplers, n)
    assert all(s.epoch == (1 if n else 0) and s.next_index == 0 for s in samplers)
    reference = pack(lengths, cfg.strategy, samplers[0].params, None)
    expected = {ex for b in reference.bins for ex, _, _ in items(b, lengths)}
    check_coverage(flat_items(epoch, lengths), lengths, expected)
    again = take(make_samplers(lengths, cfg, world_size), n)
    assert all(np.array_equal(a, b) for ra, rb in zip(epoch, again, strict=True) for a, b in zip(ra, rb, strict=True))


@SETTINGS
@given(
    lengths=lengths_st,
    cfg=config_st,
    worlds=st.lists(st.integers(min_value=1, max_value=8), min_size=2, max_size=3),
    cut=st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=2, max_size=2),
)
def test_resume_exact_on_same_and_other_world_sizes(lengths, cfg, worlds, cut):
    lengths = np.asarray(lengths, dtype=np.int64)
    # Uninterrupted on the first world: the reference for a same-world resume.
    first = make_samplers(lengths, cfg, worlds[0])
    n0 = first[0].microbatches_per_rank(0)
    full = take(first, n0) + take(first, first[0].microbatches_per_rank(1))  # epoch 0 and epoch 1

    samplers, served = make_samplers(lengths, cfg, worlds[0]), []
    for hop in range(len(worlds)):
        left = samplers[0].microbatches_per_rank(0) - samplers[0].next_index
        k = min(int(cut[min(hop, 1)] * left), left - 1) if hop < len(worlds) - 1 else left
        served += take(samplers, max(k, 0))
        if hop < len(worlds) - 1:
            state = samplers[0].state_dict()
            assert all(s.state_dict() == state for s in samplers)
            nxt = worlds[hop + 1]
            samplers = make_samplers(lengths, cfg, nxt)
            for s in samplers:
                s.load_state_dict(dict(state))
            if nxt == worlds[0] and hop == 0:  # same world: exactly the uninterrupted order
                rest = take(samplers, n0 - len(served))
                assert all(
                    np.array_equal(a, b)
                    for ra, rb in zip(served + rest, full[:n0], strict=True)
                    for a, b in zip(ra, rb, strict=True)
                )
                served += rest
                break
    # The epoch is complete: everything served exactly once, whatever the world sizes.
    reference = pack(lengths, cfg.strategy, first[0].params, None)
    expected = {ex for b in reference.bins for ex, _, _ in items(b, lengths)}
    check_coverage(flat_items(served, lengths), lengths, expected)
    assert all(s.epoch == (1 if served else 0) for s in samplers)
