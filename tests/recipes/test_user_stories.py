"""Three user stories, run as a user types them: a local model folder of another family fine-tuned with no
group switch; pre-tokenized Parquet; a broken folder whose library error is shown in one line."""

from __future__ import annotations

import json

import pytest

from tests.recipes.test_recipes import assert_ok, python_train

QUICK = ["max_steps=2", "optim.warmup_steps=1", "logger.peak_tflops=1", "eval.every=0", "eval.max_examples=20"]


@pytest.fixture(scope="module")
def my_model(tmp_path_factory, cache_dir):
    """A saved tiny Llama (another family than the default GPT-2) with its ChatML tokenizer, and a JSONL
    of chats for it, as a user's own workflow would leave them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.config import DataConfig, ModelConfig
    from trainer.data import load_records, load_tokenizer

    chats = DataConfig(source="chat_synthetic", num_records=80, cache_dir=cache_dir)
    tokenizer = load_tokenizer(ModelConfig(chat_template="chatml", tokenizer_vocab_size=512), chats)
    root = tmp_path_factory.mktemp("user")
    folder = root / "my-llama"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=384,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in load_records(chats)))
    return folder, data, tokenizer


@pytest.mark.slow
def test_my_local_model_of_another_family_trains_with_no_group_switch(my_model, tmp_path):
    folder, data, _ = my_model
    run_dir = tmp_path / "run"
    proc = python_train(
        [f"model.name_or_path={folder}", "data=jsonl", f"data.path={data}", *QUICK, f"run_dir={run_dir}"], cwd=tmp_path
    )
    assert_ok(proc)
    log = proc.stdout + proc.stderr
    assert f"model {folder}: llama," in log  # the folder's family and sizes, not the default preset's GPT-2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["dataset"]["label_tokens"] < summary["dataset"]["tokens"]  # answers only
    assert summary["started_at"] <= summary["ended_at"]
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["time"].endswith("+00:00") and record["elapsed_s"] > 0


@pytest.mark.slow
def test_pretokenized_parquet_trains_with_the_models_tokenizer(my_model, tmp_path, cache_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.data_oracle import render_records
    from trainer.config import DataConfig
    from trainer.data import load_records

    folder, data, tokenizer = my_model
    cfg = DataConfig(source="jsonl", path=str(data), cache_dir=cache_dir)
    text = render_records(load_records(cfg), tokenizer, cfg, max_length=384)
    rows = [
        {"input_ids": ids.tolist(), "labels": [t if m else -100 for t, m in zip(ids.tolist(), mask, strict=True)]}
        for ids, mask in (text.example(i) for i in range(len(text)))
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "ids.parquet")
    run_dir = tmp_path / "run"
    proc = python_train(
        [
            "model=hf",
            f"model.name_or_path={folder}",
            "data.source=parquet",
            f"data.path={tmp_path / 'ids.parquet'}",
            "eval.holdout_fraction=0",
            *QUICK,
            f"run_dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    assert_ok(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dataset"]["label_tokens"] == text.stats.label_tokens  # the ids' labels, exactly


@pytest.mark.slow
def test_a_broken_model_folder_shows_the_library_error_in_one_line(my_model, tmp_path):
    folder, _, _ = my_model
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes()[:1000] if f.suffix == ".safetensors" else f.read_bytes())
    proc = python_train(
        ["model=hf", f"model.name_or_path={broken}", *QUICK, f"run_dir={tmp_path / 'run'}"], cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("packfsdp:")]
    assert lines == [
        f"packfsdp: load error: cannot load model.name_or_path={broken}: SafetensorError: "
        "Error while deserializing header: invalid header length"
    ], proc.stderr[-2000:]
    assert "Traceback" in proc.stdout + proc.stderr  # the detail is in the log
