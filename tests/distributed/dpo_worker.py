"""Cases of tests/distributed/test_dpo.py, run under torchrun with 2 gloo ranks on CPU (``tests.distributed.workers``).

Per family (GPT-2, a Qwen2 with GQA) and mode (full fine-tuning with a live reference: a frozen copy sharded
like the policy; LoRA: the base with the adapters off), fp32: the DPO gradients of one global batch of 4
packed pair micro-batches, on one unsharded process and under FSDP2 over 2 ranks (2 micro-batches each),
each normalised by the GLOBAL pair count. ``run_cases`` returns one record per case.
"""

from __future__ import annotations

import torch

from tests.distributed.lora_worker import SIZES as LORA_SIZES
from trainer import distributed
from trainer.collate import collate_packed
from trainer.config import DataConfig, DPOConfig, ModelConfig, ParallelConfig, PeftConfig
from trainer.data import load_dataset, load_tokenizer
from trainer.model import build_model, resolve_backend
from trainer.model.lora import apply_peft
from trainer.objectives.dpo import PairLoss
from trainer.objectives.reference import plan_reference
from trainer.parallel import build_mesh, parallelize, set_gradient_sync

SIZES = {
    "gpt2": LORA_SIZES["gpt2"],
    "qwen2": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
}
CFG = DPOConfig(beta=0.5)


def policy(family: str, lora: bool, tokenizer, **overrides):
    model_cfg = ModelConfig(family=family, config_overrides=SIZES[family] | overrides)
    model = build_model(model_cfg, tokenizer, resolve_backend("sdpa_varlen", torch.device("cpu")), seed=5)
    model.use_loss("chunked", chunk_tokens=64)
    if lora:
        model = apply_peft(model, PeftConfig(method="lora", rank=4, alpha=8.0), model_cfg, seed=5)
        with torch.no_grad():  # B = 0 at init would make the adapters-off reference equal the policy
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


def accumulate(model, objective, batches, global_pairs: float) -> float:
    total = 0.0
    for i, batch in enumerate(batches):
        set_gradient_sync(model, i == len(batches) - 1)
        loss_sum, _ = objective.loss_sum(model, batch)
        (loss_sum / global_pairs).backward()
        total += float(loss_sum.detach())
    return total


def run_case(family: str, lora: bool, tokenizer, microbatches, rank: int) -> dict:
    global_pairs = float(sum(b.num_pairs for b in microbatches))
    one = policy(family, lora, tokenizer)
    with torch.no_grad():  # the full model's reference moves away from the policy, as after training steps
        one_plan = plan_reference(CFG, one)
        for p in one.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    one_ref = one_plan.build(one, lambda m: m, [], 0, torch.device("cpu"))
    loss_one = accumulate(one, PairLoss(CFG, one_ref), microbatches, global_pairs)

    cfg = ParallelConfig(device="cpu", backend="gloo", param_dtype="float32", reduce_dtype="float32")
    mesh = build_mesh(torch.device("cpu"), 2, cfg)
    model = policy(family, lora, tokenizer)
    plan = plan_reference(CFG, model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    model = parallelize(model, mesh, cfg)
    ref = plan.build(model, lambda m: parallelize(m, mesh, cfg), [], 0, torch.device("cpu"))
    local = accumulate(model, PairLoss(CFG, ref), microbatches[2 * rank : 2 * rank + 2], global_pairs)
    loss_two = distributed.all_reduce_sum([local], torch.device("cpu"))[0]
    grads = {n: p.grad for n, p in one.named_parameters() if p.requires_grad}
    diffs = {
        n: float((p.grad.full_tensor() - grads[n]).abs().max()) for n, p in model.named_parameters() if p.requires_grad
    }
    sharded_ref = ref.model if plan.kind == "copy" else None
    return {
        "max_grad_diff": max(diffs.values()),
        "params": len(diffs),
        "loss_diff": abs(loss_one - loss_two),
        "loss": loss_one / global_pairs,
        "reference": plan.kind,
        "reference_sharded": sharded_ref is not None
        and all(hasattr(p, "full_tensor") for p in sharded_ref.parameters()),
        "reference_frozen": sharded_ref is None or not any(p.requires_grad for p in sharded_ref.parameters()),
    }


def precompute_case(tokenizer, pairs, microbatches) -> dict:
    """``dpo.reference=precompute`` over 2 ranks: the pass leaves the policy sharded (the optimizer is built
    from its parameters next) and stores what the live reference computes."""
    from dataclasses import replace

    # bf16 compute: FSDP2's gathered parameters are then copies, which an optimizer must never be given
    cfg = ParallelConfig(device="cpu", backend="gloo", param_dtype="bfloat16", reduce_dtype="float32")
    mesh = build_mesh(torch.device("cpu"), 2, cfg)
    model = policy("qwen2", False, tokenizer, tie_word_embeddings=True)  # as the recipe's
    live_plan, plan = plan_reference(CFG, model), plan_reference(replace(CFG, reference="precompute"), model, "test")
    model = parallelize(model, mesh, cfg)
    live = live_plan.build(model, lambda m: parallelize(m, mesh, cfg), [], 0, torch.device("cpu"))
    stored = plan.build(model, None, [pairs], 512, torch.device("cpu"), tokenizer.pad_token_id)
    sharded = all(hasattr(p, "full_tensor") for p in model.parameters())
    batches = [collate_packed(pairs, b.example_ids[::2], tokenizer.pad_token_id) for b in microbatches]  # now with them
    diff = max(float(((stored.logps(b) - live.logps(b)) / live.logps(b)).abs().max()) for b in batches)
    return {"policy_sharded_after": sharded, "max_logp_rel_diff": diff}


def run_cases(cache: str) -> dict[str, dict]:
    rank = distributed.rank()
    tokenizer = load_tokenizer(ModelConfig(), DataConfig(num_records=300, cache_dir=cache))
    pairs = load_dataset(DataConfig(source="preference_synthetic", num_records=16, cache_dir=cache), tokenizer, 512)
    microbatches = [collate_packed(pairs, list(range(3 * i, 3 * i + 3)), tokenizer.pad_token_id) for i in range(4)]
    cases = {
        f"{family}_{'lora' if lora else 'full'}": run_case(family, lora, tokenizer, microbatches, rank)
        for family in SIZES
        for lora in (False, True)
    }
    return cases | {"precompute": precompute_case(tokenizer, pairs, microbatches)}
