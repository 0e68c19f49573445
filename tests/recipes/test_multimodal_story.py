"""A user's multimodal checkpoint fine-tuned on text, as typed: a tiny Gemma3ForConditionalGeneration folder
trains its language model through ``model=hf`` on 2 ranks (FSDP2, bf16 compute), and ``packfsdp export`` writes
a Gemma3ForConditionalGeneration folder back that transformers loads, giving the trained model's logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from tests.conftest import run_torchrun
from tests.unit.test_multimodal import tiny_gemma3
from trainer.tools.export import main as export_main

pytestmark = pytest.mark.slow


def test_a_gemma3_checkpoint_trains_on_two_ranks_and_exports_back(tokenizer, tmp_path, cache_dir):
    folder = tiny_gemma3(tmp_path / "gemma3", tokenizer)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    args = [
        "model=hf",
        f"model.name_or_path={folder}",
        "parallel.device=cpu",
        "parallel.backend=gloo",
        "data.num_records=200",
        f"data.cache_dir={cache_dir}",
        "max_steps=3",
        "optim.warmup_steps=1",
        "logger.peak_tflops=1",
        "eval.every=0",
        f"run_dir={run_dir}",
    ]
    proc = run_torchrun(["-m", "tests.distributed.harness", *args], env={"PFTEST_OUT": str(out)})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "training its language model as Gemma3ForCausalLM" in log and "; self-check packed micro-batch" in log
    assert "FSDP2 over 2 ranks" in log and "params bfloat16" in log

    export_main([f"checkpoint={run_dir}", f"out={tmp_path / 'hf'}"])
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf").eval()
    assert type(exported).__name__ == "Gemma3ForConditionalGeneration"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        "Gemma3ForConditionalGeneration"
    ]
    probe = load_file(out / "logits.safetensors")["logits"]  # [tokens, 1 + vocab]: the sharded model, bf16 compute
    with torch.no_grad():
        logits = exported(input_ids=probe[:, 0].long()[None]).logits[0]
    scale = float(probe[:, 1:].abs().max())
    torch.testing.assert_close(logits, probe[:, 1:], rtol=0, atol=2e-2 * scale)  # bf16 compute vs fp32
    before, after = load_file(folder / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        if "language_model" not in name:
            assert torch.equal(after[name], tensor), name  # the vision tower and projector, bit for bit
