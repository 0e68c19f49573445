"""The case of tests/distributed/test_router_aux.py, run under torchrun with 2 gloo ranks on CPU
(``tests.distributed.workers``).

A tiny Mixtral with its router aux loss on (``trainer.router_aux``), FSDP2 fp32, the chunked loss: one step of
4 packed micro-batches (2 per rank), each taken as the loop takes it (its summed token loss over the global
label count plus coef x its aux weighed by its share of the global real tokens), against the same 4
micro-batches on one unsharded process: the step's objective, its aux loss and every gradient.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

from trainer import distributed
from trainer.collate import collate_packed
from trainer.config import DataConfig, ModelConfig, ParallelConfig
from trainer.data import load_dataset, load_tokenizer
from trainer.model import build_model, resolve_backend
from trainer.parallel import build_mesh, parallelize, set_gradient_sync
from trainer.router_aux import use_router_aux

FP32 = ParallelConfig(device="cpu", backend="gloo", param_dtype="float32", reduce_dtype="float32")
MIXTRAL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    num_local_experts=4,
    num_experts_per_tok=2,
    output_router_logits=True,
    router_aux_loss_coef=0.05,
)


def step(model, batches, labels: float, tokens: float) -> tuple[float, float, dict[str, torch.Tensor]]:
    """(summed objective, summed aux share, full gradients) of ``batches`` taken as the loop takes them."""
    objective = aux_sum = 0.0
    for i, batch in enumerate(batches):
        set_gradient_sync(model, i == len(batches) - 1)
        loss_sum, stats = model.token_loss(**batch.model_inputs(), labels=batch.labels, router=True)
        aux = model.router_aux.step_share(stats, batch.num_tokens, tokens)
        value = loss_sum / labels + model.router_aux.coef * aux
        value.backward()
        objective, aux_sum = objective + float(value.detach()), aux_sum + float(aux.detach())
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    return objective, aux_sum, grads


def run_cases(cache: str) -> dict[str, dict]:
    device = torch.device("cpu")
    data_cfg = DataConfig(num_records=300, cache_dir=cache)  # the chunked-loss worker's data: tokenized once
    model_cfg = ModelConfig(family="mixtral", config_overrides=MIXTRAL)
    tokenizer = load_tokenizer(model_cfg, data_cfg)
    dataset = load_dataset(data_cfg, tokenizer, max_length=256)
    base = build_model(model_cfg, tokenizer, resolve_backend("sdpa_varlen", device), seed=7)
    base.use_loss("chunked")
    use_router_aux(base, cp=1, objective="sft")
    sizes = (3, 5, 2, 6)  # micro-batches of different sizes: their weights differ
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    batches = [
        collate_packed(dataset, list(range(s, s + n)), tokenizer.pad_token_id)
        for s, n in zip(starts, sizes, strict=True)
    ]
    labels = float(sum(b.num_label_tokens for b in batches))
    tokens = float(sum(b.num_tokens for b in batches))
    ref_objective, ref_aux, ref_grads = step(copy.deepcopy(base), batches, labels, tokens)

    model = parallelize(copy.deepcopy(base), build_mesh(device, distributed.world_size(), FP32), FP32)
    rank = distributed.rank()
    objective, aux, grads = step(model, batches[2 * rank : 2 * rank + 2], labels, tokens)
    objective, aux = distributed.all_reduce_sum([objective, aux], device)
    worst = max((float((grads[n] - g).abs().max()), n) for n, g in ref_grads.items())
    return {
        "fp32": {
            "objective_rel_diff": abs(objective - ref_objective) / ref_objective,
            "aux_rel_diff": abs(aux - ref_aux) / ref_aux,
            "aux": aux,
            "max_grad_diff": worst[0],
            "worst_param": worst[1],
            "router_grad_norm": max(float(g.norm()) for n, g in ref_grads.items() if n.endswith("gate.weight")),
        }
    }
