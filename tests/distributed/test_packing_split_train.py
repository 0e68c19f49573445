"""Two gloo ranks train on split examples (bfd_split): pieces flow through collate, FSDP2 and the loss."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_torchrun

pytestmark = pytest.mark.slow


def test_two_rank_training_on_split_pieces(tmp_path):
    out = run_torchrun(
        [
            "-m",
            "trainer.train",
            "recipe=cpu_dailydialog",
            "packing=bfd_split",
            "packing.token_budget=128",
            "data.num_records=300",
            "max_steps=3",
            "grad_accum=1",
            f"run_dir={tmp_path}",
            "logger.peak_tflops=1",  # MFU is not under test: skip measuring the CPU (seconds)
        ]
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "examples split into" in out.stdout  # examples longer than 128 tokens were kept, as pieces
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0 < r["useful_tokens"] <= r["tokens"] == r["positions"] <= 2 * 128
