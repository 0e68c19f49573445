"""Streaming on 2 gloo ranks (``recipe=cpu_chat_sft data.streaming=true``): a run resumed from its step-2
checkpoint trains steps 3-4 on the same micro-batches with the same losses as the uninterrupted run, and
both ranks take every step. (Most of its time is two torchrun start-ups.)"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.distributed.conftest import launch
from tests.distributed.test_resume import assert_tensors_equal, losses
from trainer.checkpoint import complete_checkpoints

pytestmark = pytest.mark.slow


def streaming_overrides(cache_dir: str, **extra) -> list[str]:
    base = {
        "recipe": "cpu_chat_sft", "data.streaming": "true", "data.num_dialogs": 300, "data.stream_buffer": 32,
        "data.stream_eval_records": 100, "eval.holdout_fraction": 0.1, "data.cache_dir": cache_dir,
        "data.max_length": 256, "packing.token_budget": 256, "max_steps": 4, "checkpoint.every_steps": 2,
        "checkpoint.keep_last": 0, "eval.every": 0, "model.self_check": "false", "logger.peak_tflops": 1,
    }
    return [f"{k}={v}" for k, v in (base | extra).items()]


def test_streaming_run_resumed_at_step_2_equals_the_uninterrupted_run(tmp_path, cache_dir):
    whole = tmp_path / "whole"
    launch(tmp_path / "out_whole", streaming_overrides(cache_dir, run_dir=whole))
    step2 = complete_checkpoints(whole / "checkpoints")[0]
    assert step2.name == "step_00000002" and sorted(p.name for p in (step2 / "data").iterdir()) == [
        "rank_00000.safetensors", "rank_00001.safetensors"]
    resumed = tmp_path / "resumed"
    launch(tmp_path / "out_resumed", streaming_overrides(cache_dir, run_dir=resumed, resume=step2))

    expected, got = losses(whole), losses(resumed)
    assert sorted(got) == [3, 4] and all(got[s] == expected[s] for s in got), (got, expected)
    results = [json.loads((tmp_path / out / "result.json").read_text()) for out in ("out_whole", "out_resumed")]
    examples = [r["examples"] for r in results]
    assert {s: examples[0][s] for s in ("3", "4")} == examples[1]
    assert results[0]["final_eval_loss"] == results[1]["final_eval_loss"] and results[0]["eval_examples"] > 0
    assert_tensors_equal(load_file(tmp_path / "out_resumed" / "final.safetensors"),
                         load_file(tmp_path / "out_whole" / "final.safetensors"))
    # ids are k * world + rank: every step holds examples of both ranks
    assert all({i % 2 for i in ids} == {0, 1} for ids in examples[0].values())
