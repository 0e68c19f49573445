"""benchmarks/gpu_throughput.py on CPU: it times the micro-batches training would see, and one failing
backend does not stop the others.

Its first version timed ``bins[:n]`` of best-fit-decreasing, which are the longest examples (11-21 per bin
against 69 on average) against random padded batches. Only the timing needs a GPU; which micro-batches are
timed, the per-backend isolation and the script's plumbing (``--device cpu --model tiny``) are checked here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.packing import pack_best_fit_decreasing

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_throughput.py"
BUDGET = 8192
SAMPLED = 100


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lengths(bench):
    return bench.make_lengths(20000, bench.MAX_EXAMPLE_LENGTH, seed=0)  # the script's corpus


def test_packed_sample_is_representative_not_longest_first(bench, lengths):
    all_bins = pack_best_fit_decreasing(lengths, BUDGET, None, np.random.default_rng(0))
    dataset_mean = len(lengths) / len(all_bins)
    longest_first = np.mean([len(b) for b in all_bins[: SAMPLED // 5]])
    assert longest_first < 0.5 * dataset_mean  # the bias this test guards against is real on this corpus

    for seed in range(3):
        sampled = bench.sample_microbatches(lengths, "bfd", BUDGET, SAMPLED, seed)
        per_bin = np.mean([len(b) for b in sampled])
        assert per_bin == pytest.approx(dataset_mean, rel=0.15), f"seed {seed}"
        assert np.mean(lengths[np.concatenate(sampled)]) == pytest.approx(lengths.mean(), rel=0.15)
        assert all(lengths[b].sum() <= BUDGET for b in sampled)


def test_padded_sample_is_the_padded_baselines(bench, lengths):
    """Shuffled examples, as many per micro-batch as a packed bin holds on average (the trainer's match)."""
    from trainer.config import PackingConfig
    from trainer.packing import matched_padded_batch_size

    sampled = bench.sample_microbatches(lengths, "none", BUDGET, SAMPLED, seed=0)
    matched = matched_padded_batch_size(lengths, PackingConfig(balance="tokens", token_budget=BUDGET), seed=0)
    assert {len(b) for b in sampled} == {matched}
    assert len(np.unique(np.concatenate(sampled))) == matched * SAMPLED  # one epoch: no example twice
    assert np.mean(lengths[np.concatenate(sampled)]) == pytest.approx(lengths.mean(), rel=0.05)


def test_a_failing_case_does_not_stop_the_others(bench):
    def broken():
        raise RuntimeError("CUDA error: no kernel image\nsecond line")

    results = bench.run_isolated({"packed broken": broken, "packed fine": lambda: {"useful_tok_s": 1.0}})
    assert results == {
        "packed broken": {"error": "RuntimeError: CUDA error: no kernel image"},
        "packed fine": {"useful_tok_s": 1.0},
    }


def test_cpu_plumbing_run_records_a_backend_that_fails_mid_step(bench, tmp_path, monkeypatch):
    """The whole script on a tiny model; a backend that raises inside the forward is reported, not fatal."""
    from transformers import AttentionInterface

    def fail(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated: out of memory")

    real_resolve = bench.resolve_backend
    broken = dataclasses.replace(real_resolve("sdpa_varlen", torch.device("cpu")), name="broken", fn=fail)
    monkeypatch.setitem(AttentionInterface._global_mapping, broken.hf_name, fail)  # undone after the test

    def resolve(name, device, dtype=None):
        return broken if name == "broken" else real_resolve(name, device, dtype)

    monkeypatch.setattr(bench, "resolve_backend", resolve)
    out = tmp_path / "throughput.json"
    bench.main(
        [
            "--device",
            "cpu",
            "--model",
            "tiny",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--examples",
            "2000",
            "--budget",
            "1024",
            "--backends",
            "broken",
            "nonsense",
            "sdpa_varlen",
            "--json",
            str(out),
        ]
    )
    results = json.loads(out.read_text())["results"]
    assert results["packed broken"] == {"error": "OutOfMemoryError: simulated: out of memory"}
    assert results["packed nonsense"]["error"].startswith("AttentionBackendError: model.attention='nonsense'")
    for label in ("packed sdpa_varlen", "padded sdpa"):
        assert results[label]["useful_tok_s"] > 0 and results[label]["useful"] <= results[label]["positions"]
    assert results["packed sdpa_varlen"]["positions"] == results["packed sdpa_varlen"]["useful"] + len(
        bench.sample_microbatches(bench.make_lengths(2000, 1024, seed=0), "bfd", 1024, 1, seed=0)[0]
    )  # the timed micro-batch is the sampler's first: every example loses one label (its first token)


def test_a_padded_batch_that_does_not_fit_is_accumulated_over_row_slices(bench, lengths, monkeypatch):
    """On the H200 the Qwen2.5-0.5B padded micro-batch (138 examples padded to the longest, 152k vocabulary)
    ran out of memory and the baseline was lost: it is now measured over 2, 4, ... accumulated row-slices,
    the same examples and label tokens per step, each slice padded to its own longest."""
    from trainer.model import VarlenCausalLM, resolve_backend

    idx = bench.sample_microbatches(lengths[:400], "none", 2048, 1, seed=0)[0]
    batch = bench.padded_batch(lengths[:400], idx, torch.device("cpu"), torch.Generator().manual_seed(0), 512)
    parts = bench.split_rows([batch], 4)
    assert len(parts) == 4 and sum(p[2] for p in parts) == batch[2]  # every label token, once
    assert sum(p[3] for p in parts) <= batch[3]  # each slice padded to its own longest

    from transformers import AutoConfig, AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(**bench.MODELS["tiny"]))
    model = VarlenCausalLM(base, resolve_backend("sdpa_varlen", torch.device("cpu")))
    forward = model.forward

    def small_memory(**inputs):  # more than 8 rows at once do not fit
        if inputs["input_ids"].shape[0] > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.45 GiB")
        return forward(**inputs)

    monkeypatch.setattr(model, "forward", small_memory)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    result = bench.run_padded(model, [batch], steps=1, warmup=0, device=torch.device("cpu"))
    expected = next(k for k in (1, 2, 4, 8, 16, 32, 64) if -(-len(idx) // k) <= 8)
    assert len(idx) > 8 and result["pieces"] == expected
    assert result["useful"] == batch[2]
    line = bench.format_results({"padded sdpa": result}, "padded sdpa")[0]
    assert f"{result['pieces']} pieces accumulated" in line
