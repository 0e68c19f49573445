"""The context-parallel layout in-process: every token held exactly once, balanced splits even out the
attention cost, the group's shards count each label once, and models cp cannot make exact are refused."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.collate import collate_packed
from trainer.parallel.cp_layout import assign_tokens, attention_cost, plan_shards, shard_batch
from trainer.parallel.route import refuse_unshardable


class _Examples:
    def __init__(self, lengths):
        self.tokens = [np.arange(1, n + 1) for n in lengths]

    def example(self, i):
        return self.tokens[i], np.ones(len(self.tokens[i]), dtype=bool)


@pytest.mark.parametrize("split", ["contiguous", "balanced"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_token_once_and_labels_counted_once(cp, split):
    lengths = [37, 1, 5, 64, 2, 9]
    held = np.concatenate(assign_tokens(lengths, cp, split))
    assert sorted(held.tolist()) == list(range(sum(lengths)))
    row = collate_packed(_Examples(lengths), np.arange(len(lengths)))
    shards = [shard_batch(row, cp, r, split, None, "sdpa_varlen") for r in range(cp)]
    assert sum(s.num_label_tokens for s in shards) == row.num_label_tokens
    assert sum(s.num_tokens for s in shards) == row.num_tokens
    assert len({s.input_ids.shape[1] for s in shards}) == 1  # equal shards for the all-gather
    # each shard's attention pairs (the step metrics' cp_skew) are the layout's cost of that rank
    assert [s.shard.pairs for s in shards] == attention_cost(lengths, cp, split).tolist()


def test_balanced_evens_out_attention_cost():
    lengths = [1000, 24, 300]
    for cp in (2, 4):
        contiguous, balanced = attention_cost(lengths, cp, "contiguous"), attention_cost(lengths, cp, "balanced")
        assert balanced.max() / balanced.mean() < 1.02 < contiguous.max() / contiguous.mean()


def test_keys_of_a_run_are_its_example_up_to_itself():
    shards = plan_shards([0, 10, 14], 2, "contiguous")  # 7 slots each: rank 1 holds a7 a8 a9 and b0..b3
    s = shards[1]
    assert s.cu_seqlens_q.tolist() == [0, 3, 7]
    assert s.cu_seqlens_k.tolist() == [0, 10, 14]  # a0..a9, then b0..b3


def test_length_dependent_rope_is_refused_under_cp():
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.config import ConfigError

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    model = LlamaForCausalLM(config)
    refuse_unshardable(model, 1)
    with pytest.raises(ConfigError, match="parallel.cp=2: .*dynamic/longrope"):
        refuse_unshardable(model, 2)


def test_inspect_shows_what_each_cp_rank_holds_and_analyze_runs_under_cp(cache_dir, capsys, tmp_path):
    """``packfsdp inspect`` on a cp=2 recipe: every row is followed by each rank's query runs (example, global
    tokens, positions), together holding the row's tokens once; ``packfsdp analyze`` deals one dp group."""
    import re

    from trainer.tools import analyze, inspect_batches

    overrides = ["recipe=cpu_long_context", "data.num_records=60", f"data.cache_dir={cache_dir}"]
    inspect_batches.main([*overrides, "num_batches=1", "show_tokens=2"])
    out = capsys.readouterr().out
    row = int(re.search(r"packed row: \d+ examples, (\d+)/1024 tokens", out).group(1))
    held = [int(n) for n in re.findall(r"rank \d: (\d+) tokens \+ \d+ pads", out)]
    assert len(held) == 2 and sum(held) == row
    spans = [(int(a), int(b)) for a, b in re.findall(r"tokens (\d+)-(\d+) \(positions", out)]
    assert sorted(t for a, b in spans for t in range(a, b + 1)) == list(range(row))  # each token on one rank
    figures = analyze.run([*overrides, f"output_root={tmp_path}", "--world-sizes", "2"])
    assert figures["examples"] > 0
