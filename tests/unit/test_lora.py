"""LoRA (``trainer.model.lora``): adapters injected by peft keep packed == one by one, only adapters train."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import compose_job, tiny_gpt2_config
from tests.unit.test_model_families import assert_equivalent, examples, tiny_model
from trainer.collate import collate_packed
from trainer.config import ConfigError, ModelConfig, OptimConfig, PeftConfig
from trainer.model import build_model, measure, resolve_backend
from trainer.model.lora import apply_peft, base_fingerprint, base_mismatch, save_lora_assets, trainable_counts
from trainer.optim import build_optimizer

LORA = PeftConfig(method="lora", rank=4, alpha=8.0)


def with_lora(model, cfg: PeftConfig = LORA):
    model = apply_peft(model, cfg, ModelConfig(), seed=0)
    # lora_B starts at zero (the adapted model equals the base); give it weights so that every adapter
    # matrix gets a non-zero gradient and a leak between examples would show in all of them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_adapter_gradients_packed_equal_one_by_one(family):
    model = with_lora(tiny_model(family, "sdpa_varlen"))
    assert_equivalent(model, examples(), atol=1e-5, rtol=1e-5)  # logits and every trainable parameter's grad
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)  # frozen: no grads
    assert all(model.model.get_parameter(n[len("model.") :]).grad.abs().sum() > 0 for n in trainable)


def test_optimizer_holds_the_adapters_only():
    model = with_lora(tiny_model("llama", "sdpa_varlen"))
    optimizer = build_optimizer(model, OptimConfig(optimizer={"_target_": "torch.optim.AdamW"}))
    held = [p for group in optimizer.param_groups for p in group["params"]]
    trainable, total = trainable_counts(model)
    assert sum(p.numel() for p in held) == trainable < total / 5
    assert all(p.requires_grad for p in held)


def test_lora_keeps_the_transformers_model_and_its_blocks():
    """Injected in place: the wrapper still holds the transformers model (base model, output embeddings,
    decoder blocks for FSDP), so the model's other users see what they saw."""
    model = tiny_model("llama", "sdpa_varlen")
    blocks, head = len(model.decoder_layers()), model.model.get_output_embeddings()
    model = with_lora(model)
    assert type(model.model).__name__ == "LlamaForCausalLM" and len(model.decoder_layers()) == blocks
    assert model.model.get_output_embeddings() is head and not head.weight.requires_grad


def test_target_modules_and_modules_to_save():
    cfg = PeftConfig(method="lora", target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    model = with_lora(tiny_model("llama", "sdpa_varlen"), cfg)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n.split(".")[-4] for n in trainable if ".lora_" in n} == {"q_proj", "v_proj"}
    assert "model.lm_head.weight" in trainable
    with pytest.raises(ConfigError, match="no module 'nope'"):
        apply_peft(
            tiny_model("llama", "sdpa_varlen"),
            PeftConfig(method="lora", modules_to_save=["nope"]),
            ModelConfig(),
            seed=0,
        )
    with pytest.raises(ConfigError, match="peft.target_modules"):
        apply_peft(
            tiny_model("llama", "sdpa_varlen"),
            PeftConfig(method="lora", target_modules=["nope"]),
            ModelConfig(),
            seed=0,
        )


def test_none_changes_nothing_and_the_fingerprint_sees_weights():
    model = tiny_model("gpt2", "sdpa_varlen")
    before = base_fingerprint(model.model)
    assert apply_peft(model, PeftConfig(), ModelConfig(), seed=0) is model
    assert all(p.requires_grad for p in model.parameters()) and base_fingerprint(model.model) == before
    with torch.no_grad():
        next(model.parameters())[0, 0] += 1
    assert base_fingerprint(model.model) != before


def test_self_check_passes_in_lora_mode(tokenizer, small_dataset):
    model = build_model(tiny_gpt2_config(), tokenizer, resolve_backend("sdpa_varlen", torch.device("cpu")), seed=0)
    model = with_lora(model).eval()
    result = measure(model, collate_packed(small_dataset, np.arange(5)))
    assert result.ok, result.line()


def test_peft_group_composes_and_validates():
    job = compose_job(["peft=lora", "peft.rank=4", "peft.target_modules=[c_attn]"])
    assert (job.peft.method, job.peft.rank, job.peft.alpha, job.peft.target_modules) == ("lora", 4, 32.0, ["c_attn"])
    assert compose_job([]).peft.method == "none"
    for bad, match in [
        ("peft.method=qlora", "peft.method"),
        ("peft.rank=0", "peft.rank"),
        ("peft.dropout=1.0", "peft.dropout"),
        ("peft.target_modules=[]", "target_modules"),
    ]:
        with pytest.raises(ConfigError, match=match):
            compose_job(["peft=lora", bad])


def test_resume_refuses_another_base_or_mode(tmp_path):
    """A checkpoint's adapters resume only on the base they were trained on (and LoRA only LoRA)."""
    model = with_lora(tiny_model("llama", "sdpa_varlen"))
    save_lora_assets(model, tmp_path)
    assert (tmp_path / "adapter_config.json").is_file() and base_mismatch(model, tmp_path) is None
    other = tiny_model("llama", "sdpa_varlen")
    with torch.no_grad():
        other.model.lm_head.weight[0, 0] += 1
    assert "another base model" in base_mismatch(with_lora(other), tmp_path)
    assert "LoRA run" in base_mismatch(tiny_model("llama", "sdpa_varlen"), tmp_path)
    assert "full fine-tuning" in base_mismatch(model, tmp_path / "missing")


def test_lora_recipes_are_their_sft_recipes_with_adapters():
    for lora, sft in [("cpu_chat_lora", "cpu_chat_sft"), ("qwen_chat_lora", "qwen_chat_sft")]:
        a, b = compose_job([f"recipe={lora}"]), compose_job([f"recipe={sft}"])
        assert (a.peft.method, b.peft.method) == ("lora", "none")
        assert (a.model, a.data, a.packing, a.parallel) == (b.model, b.data, b.packing, b.parallel)
    assert compose_job(["recipe=qwen_chat_lora"]).model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"


def test_optimizer_refuses_a_model_with_nothing_to_train():
    model = tiny_model("gpt2", "sdpa_varlen").requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameter"):
        build_optimizer(model, OptimConfig(optimizer={"_target_": "torch.optim.AdamW"}))


def test_an_adapter_on_the_head_makes_the_chunked_loss_step_aside():
    """The chunked loss multiplies by the head's weight itself: with a LoRA adapter on ``lm_head`` it would
    skip the adapter, so it refuses and the naive loss (through the adapted head) runs, saying why."""
    model = with_lora(
        tiny_model("llama", "sdpa_varlen"), PeftConfig(method="lora", rank=4, target_modules=["q_proj", "lm_head"])
    )
    assert model.use_loss("chunked").startswith("naive (chunked refused:")
    plain = with_lora(tiny_model("llama", "sdpa_varlen"))
    assert plain.use_loss("chunked").startswith("chunked")
