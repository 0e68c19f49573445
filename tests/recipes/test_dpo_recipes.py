"""The DPO recipes compose offline with what they promise (the generic checks of every recipe, composing
packed and padded and naming its command, are in test_recipes.py)."""

from __future__ import annotations

from tests.conftest import compose_job


def test_gpu_dpo_recipe_is_qwen_on_ultrafeedback_pairs_with_fsdp2_bf16():
    job = compose_job(["recipe=gpu_dpo_qwen"])
    assert job.objective == "dpo" and job.dpo.loss == "sigmoid" and job.dpo.reference == "live"
    assert job.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct" and job.model.family == "qwen2"
    assert (job.data.source, job.data.path, job.data.split) == ("hf", "HuggingFaceH4/ultrafeedback_binarized", "train_prefs")
    assert job.parallel.device == "cuda" and job.parallel.backend == "nccl"
    assert job.parallel.param_dtype == "bfloat16" and job.parallel.reduce_dtype == "float32"
    assert job.model.attention == "auto"  # flash_attn when installed, else torch_varlen: the log names it
    assert job.packing.strategy == "bfd" and job.packing.token_budget >= job.data.max_length


def test_gpu_dpo_recipe_runs_offline_from_local_folders_and_with_one_model(tmp_path):
    """Its header's offline form: a saved model and local pairs; precompute holds one model."""
    (tmp_path / "qwen").mkdir()
    job = compose_job(["recipe=gpu_dpo_qwen", f"model.name_or_path={tmp_path / 'qwen'}", "data.source=jsonl",
                       "data.path=/data/pairs.jsonl", "dpo.reference=precompute", "peft=lora"])
    assert job.model.name_or_path == str(tmp_path / "qwen") and job.data.source == "jsonl"
    assert job.dpo.reference == "precompute" and job.peft.method == "lora"
