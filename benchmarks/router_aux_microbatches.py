"""How far the router aux loss of packed and padded micro-batches lies apart on the same examples:
``python benchmarks/router_aux_microbatches.py [--router-scale 1,8,32] [key=value ...]`` (a run's overrides;
default: the tiny Mixtral of ``docs/families.md#moe-auxiliary-loss``). Figures: that section.

The load-balancing loss is a statistic of a micro-batch's tokens (``E * sum_e f_e * P_e``: a product of two means
over them), not a sum over its examples, so its value depends on which tokens share a micro-batch. For one
model (the run's initial weights, its routers' weights multiplied by ``--router-scale`` so that routing is as
peaked as a trained model's), over one epoch of the run's own micro-batches (``trainer.pipeline``), the aux
loss a step logs (each micro-batch's weighed by its share of the tokens, ``trainer.router_aux``) for:

- ``packed``: the run's packing (``bfd``: whole examples, best-fit decreasing into the token budget);
- ``padded``: ``packing=none`` (shuffled examples, as many per micro-batch as a packed one holds on average);
- ``alone``: every example its own micro-batch (the limit of small micro-batches);
- ``epoch``: the whole epoch as one batch (the limit of large ones).

Forward passes only, fp32, one process. Prints one JSON line per scale and the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from trainer.compose import compose_job_config
from trainer.model import build_model, resolve_backend
from trainer.pipeline import build_training_data
from trainer.router_aux import RouterStats, use_router_aux

DEFAULT = [
    "model=qwen2_tiny",
    "model.family=mixtral",
    "data.num_records=400",
    "model.config_overrides={num_local_experts:8,num_experts_per_tok:2,output_router_logits:true,"
    "router_aux_loss_coef:0.01}",
]


@torch.no_grad()
def epoch_stats(model, overrides: list[str]) -> list[tuple[int, RouterStats]]:
    """(real tokens, ``RouterStats``) of every micro-batch of epoch 0 of the run ``overrides`` describe."""
    cfg = compose_job_config(overrides)
    data = build_training_data(cfg, 0, 1, tokenizer=None)
    out = []
    for round_ in data.sampler.plan(0).rounds:
        batch = data.collate(data.dataset, round_[0], data.tokenizer.pad_token_id)
        _, stats = model.token_loss(**batch.model_inputs(), labels=batch.labels, router=True)
        out.append((batch.num_tokens, stats))
    return out


def step_aux(parts: list[tuple[int, RouterStats]]) -> float:
    """The aux loss as a step logs it: each micro-batch's weighed by its share of the tokens."""
    tokens = sum(n for n, _ in parts)
    return sum(n * float(stats.balance_loss()) for n, stats in parts) / tokens


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router-scale", default="1,8,32", help="comma-separated factors on the routers' weights")
    args, extra = parser.parse_known_args(argv)
    overrides = [*DEFAULT, *extra]
    cfg = compose_job_config([*overrides, "parallel.param_dtype=float32"])
    data = build_training_data(cfg, 0, 1)
    base = build_model(cfg.model, data.tokenizer, resolve_backend("sdpa_varlen", torch.device("cpu")), cfg.seed)
    base.use_loss(cfg.loss.impl, cfg.loss.chunk_tokens)
    aux = use_router_aux(base, 1, "sft")
    routers = [
        p for name, p in base.named_parameters() if name.endswith("gate.weight") and p.shape[0] == aux.num_experts
    ]
    original = [p.detach().clone() for p in routers]
    rows = []
    for scale in (float(s) for s in args.router_scale.split(",")):
        for p, w in zip(routers, original, strict=True):
            p.data.copy_(w * scale)
        base.eval()
        packed = epoch_stats(base, overrides)
        padded = epoch_stats(base, [*overrides, "packing=none"])
        alone = epoch_stats(base, [*overrides, "packing.max_examples_per_bin=1"])
        row = {
            "router_scale": scale,
            "packed": step_aux(packed),
            "padded": step_aux(padded),
            "alone": step_aux(alone),
            "epoch": float(RouterStats.merged([s for _, s in packed]).balance_loss()),
            "packed_microbatches": len(packed),
            "padded_microbatches": len(padded),
        }
        row["padded_minus_packed"] = row["padded"] - row["packed"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| router scale | packed | padded | padded - packed | each example alone | the epoch as one batch |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['router_scale']:g} | {r['packed']:.4f} | {r['padded']:.4f} | {r['padded_minus_packed']:+.4f} "
            f"| {r['alone']:.4f} | {r['epoch']:.4f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
