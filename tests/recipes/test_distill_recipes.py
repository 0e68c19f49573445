"""The distillation recipes compose offline with what they promise, cpu_distill's teacher recipe builds a
teacher with the student's vocabulary, and cpu_distill trains on 2 ranks with the self-check on, its teacher
live and precomputed, packed and padded (the generic checks of every recipe are in test_recipes.py)."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import REPO, compose_job, run_torchrun
from tests.unit.test_distill import save_teacher
from trainer.data import load_tokenizer


def test_gpu_distill_recipe_is_qwen_1_5b_into_0_5b_on_a_chat_set_with_fsdp2_bf16(tmp_path):
    job = compose_job(["recipe=gpu_distill_qwen"])
    assert job.objective == "distill" and job.distill.teacher == "Qwen/Qwen2.5-1.5B-Instruct"
    assert job.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct" and job.model.family == "qwen2"
    assert (job.data.source, job.data.path, job.data.loss_on) == ("hf", "HuggingFaceH4/ultrachat_200k", "auto")
    assert job.parallel.device == "cuda" and job.parallel.param_dtype == "bfloat16" and job.loss.impl == "chunked"
    assert job.distill.teacher_logits == "live" and job.packing.token_budget >= job.data.max_length
    (tmp_path / "0.5b").mkdir()  # its header's offline form: saved models, local chats
    offline = compose_job(
        [
            "recipe=gpu_distill_qwen",
            f"model.name_or_path={tmp_path / '0.5b'}",
            f"distill.teacher={tmp_path / '1.5b'}",
            "data=jsonl",
            "data.path=/data/chats.jsonl",
            "distill.teacher_logits=precompute",
        ]
    )
    assert offline.distill.teacher == str(tmp_path / "1.5b") and offline.data.source == "jsonl"


def test_cpu_distill_teacher_recipe_builds_the_students_vocabulary_where_cpu_distill_reads_it():
    """The teacher recipe trains on the student's data with the student's tokenizer settings (the local BPE is a
    function of them: the same vocabulary), and its first line exports to the folder cpu_distill names."""
    teacher, student = compose_job(["recipe=cpu_distill_teacher"]), compose_job(["recipe=cpu_distill"])
    assert teacher.data == student.data and teacher.model.tokenizer == student.model.tokenizer == "local_bpe"
    assert (teacher.model.tokenizer_vocab_size, teacher.model.chat_template) == (
        student.model.tokenizer_vocab_size,
        student.model.chat_template,
    )
    assert teacher.model.random_init["hidden_size"] > student.model.random_init["hidden_size"]
    first = (REPO / "recipes" / "cpu_distill_teacher.yaml").read_text().splitlines()[0]
    out = re.search(r"packfsdp export checkpoint=(\S+) out=(\S+)", first)
    assert out and f"run_dir={out.group(1)}" in first and student.distill.teacher == f"./{out.group(2)}"


@pytest.mark.slow
def test_cpu_distill_trains_on_two_ranks_live_and_precomputed(tmp_path):
    """``recipe=cpu_distill`` with a teacher folder of the run's own tokenizer (a random Qwen2 of another shape:
    building the real one takes minutes), as one Hydra sweep on 2 ranks: the teacher live (FSDP2-sharded, its root
    kept gathered through the student's loss) and precomputed (both ranks write the store). Each job passes the
    startup self-check on the distillation loss, trains, evaluates and logs the loss's parts. (Padded == packed:
    tests/unit/test_distill.py, and ``packfsdp compare recipe=cpu_distill``, docs/distill.md.)"""
    quick = [
        "data.num_records=200",
        f"data.cache_dir={tmp_path / 'cache'}",
        "max_steps=2",
        "summary_skip_steps=1",
        "optim.warmup_steps=1",
        "eval.every=2",
        "logger.peak_tflops=1",
        "packing.token_budget=1024",
    ]
    base = compose_job(["recipe=cpu_chat_sft", *quick[:2]])  # its own cache: the store is written, not read
    teacher = save_teacher(tmp_path / "teacher", load_tokenizer(base.model, base.data))
    sweep = [
        "-m",
        "trainer.train",
        "-m",
        "recipe=cpu_distill",
        f"distill.teacher={teacher}",
        "distill.teacher_logits=live,precompute",
        *quick,
    ]
    proc = run_torchrun(sweep, cwd=tmp_path, env={"PYTHONPATH": str(REPO)}, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("; self-check packed micro-batch") == 2 and "distill forward_kl loss" in proc.stdout
    assert "one pass of the teacher over 200 examples" in proc.stdout and "live (FSDP2-sharded, frozen" in proc.stdout
    runs = sorted(p for p in (tmp_path / "outputs" / "cpu_distill").iterdir() if p.is_dir())
    assert len(runs) == 2
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        assert summary["objective"] == "distill" and summary["steps"] == 2 and summary["world_size"] == 2
        assert summary["final_eval_loss"] > 0 and summary["final_divergence"] >= 0
        assert abs(summary["final_loss"] - 0.5 * (summary["final_cross_entropy"] + summary["final_divergence"])) < 1e-6
