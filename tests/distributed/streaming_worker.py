"""Worker for tests/distributed/test_streaming_resume.py, run under torchrun with 2 gloo ranks on CPU.

Two streaming runs of ``recipe=cpu_chat_sft data.stream.enabled=true`` in one launch (a second torchrun start-up
would double the test's time): the whole run (5 steps, checkpoints at 2, 4 and 5), then a run resumed from its
step-2 checkpoint in another run dir. Rank 0 writes, per run, the example ids of every step (all ranks),
the final eval loss and whether the final parameters and optimizer state are equal, to ``argv[1]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from tests.distributed.harness import HarnessTrainer, full_tensors
from tests.quick_exit import run_then_exit
from trainer import distributed
from trainer.compose import config_dir, register_configs, to_job_config
from trainer.data import stream as streaming


def streaming_overrides(cache_dir: str, **extra) -> list[str]:
    base = {
        "recipe": "cpu_chat_sft",
        "data.stream.enabled": "true",
        "data.num_records": 300,
        "data.stream.buffer": 4,
        "data.stream.eval_records": 100,
        "eval.holdout_fraction": 0.1,
        "data.cache_dir": cache_dir,
        "data.max_length": 256,
        "packing.token_budget": 256,
        "max_steps": 5,
        "checkpoint.every_steps": 2,
        "checkpoint.keep_last": 0,
        "eval.every": 0,
        "model.self_check": "false",
        "logger.peak_tflops": 1,
    }
    return [f"{k}={v}" for k, v in (base | extra).items()]


def run(overrides: list[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    with initialize_config_dir(str(config_dir()), version_base=None):
        cfg = to_job_config(compose("config", overrides))
    trainer = HarnessTrainer(cfg, None)
    result = trainer.train()
    record = {
        "examples": trainer.gathered_examples(),
        "final_eval_loss": result["final_eval_loss"],
        "eval_examples": result["eval_examples"],
        "steps": result["steps"],
    }
    return record, full_tensors(trainer)


def main(out: Path, cache_dir: str) -> None:
    # 4 rows at a time into a window of 4: every step reads the stream, so the resumed run's steps read it from
    # the saved position (with 256 rows a chunk, one chunk would hold a rank's whole share of 300 records).
    streaming.STREAM_CHUNK = 4
    register_configs()
    whole, whole_tensors = run(streaming_overrides(cache_dir, run_dir=out.parent / "whole"))
    step2 = out.parent / "whole" / "checkpoints" / "step_00000002"
    resumed, resumed_tensors = run(streaming_overrides(cache_dir, run_dir=out.parent / "resumed", resume=step2))
    if distributed.rank() == 0:
        same = whole_tensors.keys() == resumed_tensors.keys() and all(
            torch.equal(whole_tensors[k], resumed_tensors[k]) for k in whole_tensors
        )
        out.write_text(json.dumps({"whole": whole, "resumed": resumed, "same_final_state": same}, default=str))
    distributed.destroy_distributed()


if __name__ == "__main__":
    run_then_exit(main, Path(sys.argv[1]), sys.argv[2])
