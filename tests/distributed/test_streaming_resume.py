"""Streaming on 2 gloo ranks (``recipe=cpu_chat_sft data.stream.enabled=true``, ``streaming_worker.py``): a run
resumed from its step-2 checkpoint trains steps 3-5 on the same micro-batches, with the same losses, eval
loss and final parameters as the uninterrupted run, and both ranks take every step."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_torchrun
from tests.distributed.test_resume import losses
from trainer.checkpoint import complete_checkpoints

pytestmark = pytest.mark.slow


def test_streaming_run_resumed_at_step_2_equals_the_uninterrupted_run(tmp_path, cache_dir):
    # its own launch: the worker's trainers own the process group (the shared workers launch runs bare cases)
    proc = run_torchrun(["-m", "tests.distributed.streaming_worker", str(tmp_path / "record.json"), cache_dir])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "record.json").read_text())
    whole, resumed = record["whole"], record["resumed"]
    step2 = complete_checkpoints(tmp_path / "whole" / "checkpoints")[0]
    assert step2.name == "step_00000002" and sorted(p.name for p in (step2 / "data").iterdir()) == [
        "rank_00000.safetensors",
        "rank_00001.safetensors",
    ]

    expected, got = losses(tmp_path / "whole"), losses(tmp_path / "resumed")
    assert sorted(got) == [3, 4, 5] and all(got[s] == expected[s] for s in got), (got, expected)
    assert {s: whole["examples"][s] for s in ("3", "4", "5")} == resumed["examples"]
    assert whole["final_eval_loss"] == resumed["final_eval_loss"] and whole["eval_examples"] > 0
    assert record["same_final_state"]
    # ids are k * world + rank: every step holds examples of both ranks
    assert all({i % 2 for i in ids} == {0, 1} for ids in whole["examples"].values())
