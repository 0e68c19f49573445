"""The DPO recipes compose offline with what they promise (the generic checks of every recipe, composing
packed and padded and naming its command, are in test_recipes.py)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import REPO, compose_job, run_torchrun


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_gpu_dpo_recipe_is_qwen_on_ultrafeedback_pairs_with_fsdp2_bf16():
    job = compose_job(["recipe=gpu_dpo_qwen"])
    assert job.objective == "dpo" and job.dpo.loss == "sigmoid" and job.dpo.reference == "live"
    assert job.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct" and job.model.family == "qwen2"
    assert (job.data.source, job.data.path, job.data.split) == (
        "hf",
        "HuggingFaceH4/ultrafeedback_binarized",
        "train_prefs",
    )
    assert job.parallel.device == "cuda" and job.parallel.backend == "nccl"
    assert job.parallel.param_dtype == "bfloat16" and job.parallel.reduce_dtype == "float32"
    assert job.model.attention == "auto"  # flash_attn when installed, else torch_varlen: the log names it
    assert job.packing.strategy == "bfd" and job.packing.token_budget >= job.data.max_length


def test_gpu_dpo_recipe_runs_offline_from_local_folders_and_with_one_model(tmp_path):
    """Its header's offline form: a saved model and local pairs; precompute holds one model."""
    (tmp_path / "qwen").mkdir()
    job = compose_job(
        [
            "recipe=gpu_dpo_qwen",
            f"model.name_or_path={tmp_path / 'qwen'}",
            "data.source=jsonl",
            "data.path=/data/pairs.jsonl",
            "dpo.reference=precompute",
            "peft=lora",
        ]
    )
    assert job.model.name_or_path == str(tmp_path / "qwen") and job.data.source == "jsonl"
    assert job.dpo.reference == "precompute" and job.peft.method == "lora"


@pytest.mark.slow
def test_cpu_dpo_on_two_ranks_preempted_on_one_rank_resumes_bitwise(tmp_path):
    """``recipe=cpu_dpo`` on 2 FSDP2 ranks, SIGUSR1 on rank 1 only after step 1: both ranks stop at that step
    with its checkpoint (exit 75); ``resume=auto`` rebuilds the sharded frozen reference from the starting
    weights and trains steps 2-3 as the uninterrupted run does, bitwise (losses, DPO metrics, the eval)."""
    from trainer.stop_signals import PREEMPTED_EXIT_CODE

    quick = [
        "recipe=cpu_dpo",
        "max_steps=3",
        "data.num_records=200",
        "packing.token_budget=1024",
        "data.max_length=1024",
        "optim.warmup_steps=0",
        "logger.peak_tflops=1",
        "checkpoint.every_steps=0",
        "eval.every=0",
        "eval.holdout_fraction=0.05",
    ]
    env = {"PYTHONPATH": str(REPO)}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert_ok(run_torchrun(["-m", "trainer.train", *quick, f"run_dir={whole}"], cwd=tmp_path, env=env))
    stopped = run_torchrun(
        ["-m", "tests.faults.signal_entry", *quick, f"run_dir={cut}"],
        cwd=tmp_path,
        env=env | {"PFTEST_SIGNAL": "SIGUSR1:self:1:1"},
    )
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in stopped.stderr, stopped.stderr[-3000:]
    assert [p.name for p in (cut / "checkpoints").glob("step_*")] == ["step_00000001"]
    assert_ok(run_torchrun(["-m", "trainer.train", *quick, f"run_dir={cut}", "resume=auto"], cwd=tmp_path, env=env))

    def steps(run):
        return [
            (r["step"], r["loss"], r["grad_norm"], r["useful_tokens"], r["preference"])
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        ]

    def evals(run):
        return [
            (e["step"], e["eval_loss"], e["preference"])
            for e in map(json.loads, (run / "eval.jsonl").read_text().splitlines())
        ]

    assert [s[0] for s in steps(whole)] == [1, 2, 3]
    assert steps(cut) == steps(whole) and evals(cut) == evals(whole) and evals(whole)
