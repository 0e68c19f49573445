"""LoRA under FSDP2 on 2 gloo ranks: gradients as one process, small checkpoints, exact resume, export.

``lora_reference`` trains 4 uninterrupted LoRA steps (fp32, model and adapter dropout on, checkpoints at 2
and 4); a run resumed from its step-2 checkpoint must match it bitwise, and its checkpoint exported as a merged
model or as a peft adapter must give the trained sharded model's logits.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.conftest import launch, overrides, worker_cases
from tests.distributed.test_resume import assert_tensors_equal, losses
from trainer.checkpoint import complete_checkpoints, read_full_tensors
from trainer.tools.export import main as export_main

pytestmark = pytest.mark.slow

FP32_TOL = 1e-5


def lora_overrides(cache_dir: str, **extra) -> list[str]:
    lora = {"peft": "lora", "peft.rank": 4, "peft.dropout": 0.1, "max_steps": 4, "checkpoint.every_steps": 2}
    return overrides(cache_dir, **(lora | extra))


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("lora_reference")
    proc = launch(root / "out", lora_overrides(cache_dir, run_dir=root / "run"))
    (root / "log.txt").write_text(proc.stdout + proc.stderr)
    return root


def test_two_ranks_give_the_one_process_adapter_gradients(worker_results):
    """GPT-2 and Llama, fp32 and bf16 compute, activation checkpointing: adapters sharded, frozen weights
    without gradient or optimizer state, the optimizer holding the adapters only (tests/distributed/lora_worker.py)."""
    cases = worker_cases(worker_results, "lora_worker")
    assert set(cases) == {"gpt2_fp32", "gpt2_bf16", "llama_fp32", "llama_bf16", "llama_fp32_ac"}
    for name, case in cases.items():
        assert case["placements"] == ["(Shard(dim=0),)"] and case["optimizer_params"] == case["adapters"] > 0
        assert case["max_grad_diff"] < (2e-3 if "bf16" in name else FP32_TOL), (name, case)


def test_checkpoints_hold_the_adapters_not_the_base(lora_reference):
    log = (lora_reference / "log.txt").read_text()
    assert "LoRA: 4096 trainable parameters of" in log and "; self-check packed micro-batch" in log
    assert json.loads((lora_reference / "run" / "summary.json").read_text())["peft"] == "lora"
    last = complete_checkpoints(lora_reference / "run" / "checkpoints")[-1]
    keys = list(read_full_tensors(last))
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys[:5]
    hf = last / "hf"
    assert (hf / "adapter_config.json").is_file() and json.loads((hf / "lora_base.json").read_text())["seed"] == 1234


def test_resume_at_2_to_4_is_bitwise_equal(lora_reference, tmp_path, cache_dir):
    """From the reference's step-2 checkpoint (adapters only: the frozen base is rebuilt from the seed) in a new
    run dir, so one launch is enough; stopping with ``stop_after_steps`` and ``resume=auto`` in the same run dir
    are the same for LoRA and full weights and tested in test_resume.py."""
    run = tmp_path / "run"
    step_2 = lora_reference / "run" / "checkpoints" / "step_00000002"
    second = launch(tmp_path / "second", lora_overrides(cache_dir, run_dir=run, resume=step_2))
    ref = losses(lora_reference / "run")
    assert sorted(ref) == [1, 2, 3, 4] and losses(run) == {step: ref[step] for step in (3, 4)}, second.stdout[-2000:]
    assert json.loads((tmp_path / "second" / "result.json").read_text())["resumed_step"] == 2
    assert_tensors_equal(
        load_file(tmp_path / "second" / "final.safetensors"), load_file(lora_reference / "out" / "final.safetensors")
    )


def test_export_merged_and_adapter_give_the_trained_logits(lora_reference, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.model.lora import rebuild_base

    run = lora_reference / "run"
    export_main([f"checkpoint={run}", f"out={tmp_path / 'merged'}"])
    export_main([f"checkpoint={run}", f"out={tmp_path / 'adapter'}", "format=adapter"])
    probe = load_file(lora_reference / "out" / "logits.safetensors")["logits"]  # [tokens, 1 + vocab]
    input_ids = probe[:, 0].long()[None]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    base = rebuild_base(complete_checkpoints(run / "checkpoints")[-1] / "hf")
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        for model in (merged, adapted):
            torch.testing.assert_close(model(input_ids=input_ids).logits[0], probe[:, 1:], rtol=1e-5, atol=1e-5)


def test_export_refuses_an_adapter_of_a_full_run(reference, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        export_main([f"checkpoint={reference / 'run'}", f"out={tmp_path / 'o'}", "format=adapter"])
    assert e.value.code == 2 and "format=merged" in capsys.readouterr().err
