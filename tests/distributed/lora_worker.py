"""Cases of tests/distributed/test_lora.py, run under torchrun with 2 gloo ranks on CPU
(``tests.distributed.workers``).

Per family (GPT-2, Llama) and precision (fp32; bf16 compute with fp32 reduce), and for Llama with
activation checkpointing on every block: a LoRA model's gradients
of one global batch of 4 packed micro-batches, on one unsharded process and under FSDP2 over 2 ranks (2
micro-batches each). ``run_cases`` returns one record per case.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from trainer import distributed
from trainer.collate import collate_packed
from trainer.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, PeftConfig
from trainer.data import load_dataset, load_tokenizer
from trainer.loss import summed_token_loss
from trainer.model import build_model, resolve_backend
from trainer.model.lora import apply_peft
from trainer.optim import build_optimizer
from trainer.parallel import build_mesh, parallelize, set_gradient_sync

SIZES = {
    "gpt2": dict(n_layer=2, n_embd=32, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
}
PARALLEL = {
    "fp32": dict(param_dtype="float32", reduce_dtype="float32"),
    "bf16": dict(param_dtype="bfloat16", reduce_dtype="float32"),
    "fp32_ac": dict(param_dtype="float32", reduce_dtype="float32", activation_checkpointing="full"),
}


def lora_model(family: str, tokenizer):
    model_cfg = ModelConfig(family=family, config_overrides=SIZES[family])
    model = build_model(model_cfg, tokenizer, resolve_backend("sdpa_varlen", torch.device("cpu")), seed=3)
    model = apply_peft(model, PeftConfig(method="lora", rank=4, alpha=8.0), model_cfg, seed=3)
    with torch.no_grad():  # B = 0 at init would leave A without gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


def accumulate(model, batches, global_labels: float) -> None:
    for i, batch in enumerate(batches):
        set_gradient_sync(model, i == len(batches) - 1)
        (summed_token_loss(model, batch) / global_labels).backward()


def run_case(family: str, parallel: str, tokenizer, microbatches, rank: int) -> dict:
    global_labels = float(sum(b.num_label_tokens for b in microbatches))
    reference = lora_model(family, tokenizer)
    accumulate(reference, microbatches, global_labels)
    cfg = ParallelConfig(device="cpu", backend="gloo", **PARALLEL[parallel])
    model = parallelize(lora_model(family, tokenizer), build_mesh(torch.device("cpu"), 2, cfg), cfg)
    accumulate(model, microbatches[2 * rank : 2 * rank + 2], global_labels)
    optimizer = build_optimizer(model, OptimConfig())
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    diffs, placements = {}, set()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None and id(p) not in held, f"frozen {name} has a gradient or optimizer state"
            continue
        assert isinstance(p, DTensor) and id(p) in held, f"{name} is not a sharded parameter of the optimizer"
        placements.add(str(p.placements))
        diffs[name] = float((p.grad.full_tensor().float() - ref_grads[name]).abs().max())
    return {
        "max_grad_diff": max(diffs.values()),
        "adapters": len(diffs),
        "placements": sorted(placements),
        "optimizer_params": len(held),
    }


def run_cases(cache: str) -> dict[str, dict]:
    rank = distributed.rank()
    data_cfg = DataConfig(num_records=300, cache_dir=cache)
    tokenizer = load_tokenizer(ModelConfig(), data_cfg)
    dataset = load_dataset(data_cfg, tokenizer, max_length=256)
    microbatches = [collate_packed(dataset, list(range(3 * i, 3 * i + 3)), tokenizer.pad_token_id) for i in range(4)]
    cases = [(family, parallel) for family in SIZES for parallel in ("fp32", "bf16")] + [("llama", "fp32_ac")]
    return {
        f"{family}_{parallel}": run_case(family, parallel, tokenizer, microbatches, rank) for family, parallel in cases
    }
