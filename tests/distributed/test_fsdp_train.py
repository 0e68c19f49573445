"""Two gloo ranks on CPU run real FSDP2 steps (bf16 MixedPrecisionPolicy), packed and padded."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("packing", ["bfd", "none"])
def test_two_rank_fsdp_training(packing, tmp_path):
    run_dir = tmp_path / packing
    out = run_torchrun([
        "-m", "trainer.train", "recipe=cpu_dailydialog", f"packing={packing}", "data.num_dialogs=600",
        "packing.token_budget=512", "data.max_length=512", "max_steps=12", "grad_accum=2", "optim.lr=3e-3", "optim.warmup_steps=2",
        f"run_dir={run_dir}", "logger.peak_tflops=1",  # MFU is not under test: skip measuring the CPU (seconds)
    ])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < first - 0.3, (first, last)
    for r in records:
        assert r["useful_tokens"] > 0 and r["useful_tokens_per_s"] > 0
        assert r["useful_tokens"] <= r["tokens"] <= r["positions"]
    if packing == "bfd":
        assert all(r["padding_fraction"] == 0.0 for r in records)
        assert "attention backend: sdpa_varlen" in out.stdout
    else:
        assert sum(r["padding_fraction"] for r in records) / len(records) > 0.2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["mode"] == ("packed" if packing == "bfd" else "padded")
    assert (run_dir / "config.yaml").is_file()
