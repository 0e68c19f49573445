"""Which ``packing.balance`` measure balances the model's FLOPs across data-parallel ranks (a script, not a test).

    python benchmarks/balance_flops.py [--worlds 4,16] [--n 20000]
    python benchmarks/balance_flops.py --pairs [--worlds 8,32]     # preference pairs: costed as one or two sequences

For each workload (example lengths) and model (its FLOPs per example length, ``TokenCost``: matmul parameters
x length + causal attention x length^2, from ``trainer.throughput.token_cost``), the sampler deals one epoch's
bins to W ranks balancing ``tokens``, ``attention`` or ``flops``; the figure is the max/mean skew of **FLOPs**
per rank per optimizer step (``rank_balance``: sum over steps of the busiest rank's FLOPs over the sum of the
mean, minus 1 -- the share of time ranks wait if time ~ FLOPs) and the worst single step.

Workloads:
- ``cpu_long_context``: the recipe's own generated reasoning-trace corpus (tokenized as the trainer does),
  rows of ``cp x token_budget`` = 1024 tokens, with the recipe's GPT-2 (2 x 128) and with Qwen2.5-0.5B's sizes;
- ``chat``: DailyDialog-like dialog lengths (``trainer.data.synthetic``), 2048-token bins;
- ``long_cot``: a heavy-tailed length mix (Pareto, scale 512, cap 32k) in 32k-token rows, the GPU recipe's
  regime (Qwen2.5-0.5B sizes).

``--pairs``: DPO pairs of UltraFeedback-like lengths (``ultrafeedback_like_pairs``, the prompt stored twice),
Qwen2.5-0.5B sizes, ``balance=flops``: the FLOPs skew when a pair is costed as one sequence of its total length (before)
and as its two sequences (``pair_splits``: what the collate runs), in 4k rows and the GPU recipe's 16k.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.figures import captured, markdown_argument, publish
from trainer.config import PackingConfig
from trainer.data.synthetic import (
    dailydialog_like_lengths,
    heavy_tailed_lengths,
    ultrafeedback_like_pairs,
)
from trainer.packing import WORK_MEASURES, MicroBatchSampler, TokenCost, item_work


def qwen2_5_0_5b_cost() -> TokenCost:
    """Qwen2.5-0.5B's published sizes (24 x 896, GQA 14/2, MLP 4864, vocab 151936, tied), on the meta device."""
    from transformers import Qwen2Config

    from trainer.throughput import config_flop_params, token_cost

    config = Qwen2Config(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    )
    return token_cost(config_flop_params(config))


def recipe_corpus():
    """The cpu_long_context recipe's training examples and its model's ``TokenCost``, as the trainer builds them."""
    from trainer.compose import compose_job_config
    from trainer.pipeline import build_training_data

    cfg = compose_job_config(["recipe=cpu_long_context", "packing.balance=flops"])
    data = build_training_data(cfg)
    return cfg, data.dataset, data.sampler.cost


def flops_skew(lengths: np.ndarray, budget: int, world: int, balance: str, cost: TokenCost, seed: int = 0):
    """(skew, worst step skew) of FLOPs per rank per step when the deal balances ``balance``."""
    cfg = PackingConfig(strategy="bfd", token_budget=budget, balance=balance)
    sampler = MicroBatchSampler(lengths, cfg, 0, world, seed, cost=cost, oversize="drop")
    report = sampler.balance_report(0, weight=lambda b: float(cost.of(lengths[b]).sum()))
    return report["skew"], report["worst_step_skew"], sampler


def pair_costing(n: int, worlds: list[int]) -> None:
    """The ``--pairs`` table: FLOPs skew (the truth: each pair's two sequences) of a deal costing a pair as
    one sequence vs as two."""
    parts = ultrafeedback_like_pairs(n, np.random.default_rng(0))
    lengths, splits = 2 * parts["prompt"] + parts["chosen"] + parts["rejected"], parts["prompt"] + parts["chosen"]
    cost = qwen2_5_0_5b_cost()
    print("| token budget | W | skew, a pair costed as one sequence (worst step) | as two sequences (worst step) |")
    print("|---|---|---|---|")
    for budget in (4096, 16384):
        for w in worlds:
            cells = []
            for pair_splits in (None, splits):
                cfg = PackingConfig(strategy="bfd", token_budget=budget, balance="flops")
                sampler = MicroBatchSampler(lengths, cfg, 0, w, 0, cost=cost, pair_splits=pair_splits)
                report = sampler.balance_report(0, weight=lambda b: float(item_work(b, lengths, cost.of, splits).sum()))
                cells.append(f"{100 * report['skew']:.2f}% ({100 * report['worst_step_skew']:.1f}%)")
            print(f"| {budget} | {w} | " + " | ".join(cells) + " |")
    whole = cost.of(lengths).sum() / item_work(np.arange(n), lengths, cost.of, splits).sum() - 1
    print(
        f"\n{n} pairs, median {int(np.median(lengths))} tokens, max {lengths.max()}; costed as one sequence, "
        f"their FLOPs are overstated by {100 * whole:.1f}%"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="4,16", help="data-parallel world sizes")
    parser.add_argument("--n", type=int, default=20000, help="examples of the generated workloads")
    parser.add_argument("--pairs", action="store_true", help="the preference-pair costing table instead")
    markdown_argument(parser)
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    with captured() as table:
        (pair_costing if args.pairs else workload_skews)(args.n, worlds)
    publish(args.markdown, "benchmarks/balance_flops.py" + (" --pairs" if args.pairs else ""), table.text())


def workload_skews(n: int, worlds: list[int]) -> None:
    """The table of FLOPs skew per workload, model and world size under each ``packing.balance``."""
    cfg, dataset, tiny = recipe_corpus()
    qwen = qwen2_5_0_5b_cost()
    chat = dailydialog_like_lengths(n, seed=1)
    cot = heavy_tailed_lengths(n, seed=2, scale=512, cap=32768)
    cases = [
        ("cpu_long_context", "gpt2_tiny (recipe)", dataset.lengths, cfg.row_budget, tiny),
        ("cpu_long_context", "Qwen2.5-0.5B sizes", dataset.lengths, cfg.row_budget, qwen),
        ("chat (dailydialog-like)", "Qwen2.5-0.5B sizes", chat, 2048, qwen),
        ("long_cot (pareto, 32k rows)", "Qwen2.5-0.5B sizes", cot, 32768, qwen),
    ]
    print(
        "| workload | model | attention share of FLOPs | W | "
        + " | ".join(f"skew balance={m} (worst step)" for m in WORK_MEASURES)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(WORK_MEASURES))
    for name, model, lengths, budget, cost in cases:
        kept = lengths[lengths <= budget]
        share = cost.per_pair * float((kept.astype(np.float64) ** 2).sum()) / float(cost.of(kept).sum())
        for w in worlds:
            cells = []
            for m in WORK_MEASURES:
                skew, worst, _ = flops_skew(lengths, budget, w, m, cost)
                cells.append(f"{100 * skew:.2f}% ({100 * worst:.1f}%)")
            print(f"| {name} | {model} | {100 * share:.0f}% | {w} | " + " | ".join(cells) + " |")
    print(
        f"\n{len(dataset)} cpu_long_context examples (mean {dataset.lengths.mean():.0f}, max {dataset.lengths.max()} "
        f"tokens); TokenCost gpt2_tiny {tiny}; Qwen2.5-0.5B {qwen}"
    )


if __name__ == "__main__":
    main()
