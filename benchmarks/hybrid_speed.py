"""A hybrid model (token mixers outside attention) packed vs padded vs one by one on CPU: useful tokens/s.

    python benchmarks/hybrid_speed.py [--family qwen3_next|nemotron_h] [--budget 2048] [--bins 3] [--reps 3]

The model is a ~28M Qwen3-Next-shaped config (8 layers: gated delta-rule linear attention and full attention
3:1, dense MLPs, hidden 512, vocabulary 2048) or a ~30M Nemotron-H-shaped one (8 blocks: 4 Mamba-2, 1
attention, 3 MLP, hidden 768), random weights, fp32. Its mixers run as ``build_model`` prepares them
(``trainer.model.mixers``: the ``per_example`` route on CPU).

For each workload of ``trainer.data.synthetic.WORKLOADS`` (DailyDialog-like lengths; a heavy tail, capped at the
budget) ``--bins`` packed micro-batches are drawn from best-fit-decreasing bins of ``--budget`` tokens; the
same examples are then timed as the padded baseline batches them (shuffled, as many per micro-batch as a
packed one holds on average, right-padded to the longest) and one by one (one example per forward). Each
pass is forward + backward of the summed token loss (``VarlenCausalLM`` with the run's default loss);
median CPU seconds of ``--reps`` passes (one thread: the process's CPU time, which other jobs on a shared
machine do not inflate as they do wall time), the passes taking turns. Useful tokens are
tokens with a label (every token of an example but its first). Prints useful tokens/s and packed / padded.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.attention_speed import median_times
from trainer.collate import IGNORE_INDEX, Batch
from trainer.config import LossConfig
from trainer.data.synthetic import WORKLOADS
from trainer.model.attention import AttentionNeeds, resolve_backend
from trainer.model.certification.engine import packed_batch
from trainer.model.prepare import prepare_model
from trainer.packing.strategies import batch_padded, pack_best_fit_decreasing

VOCAB = 2048
SHAPES = {
    "qwen3_next": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        mlp_only_layers=list(range(8)),
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    ),
    "nemotron_h": dict(
        hidden_size=768,
        intermediate_size=2304,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        layers_block_type=["mamba", "mlp", "mamba", "attention", "mamba", "mlp", "mamba", "mlp"],
        mamba_num_heads=24,
        mamba_head_dim=64,
        ssm_state_size=64,
        n_groups=1,
        chunk_size=128,
    ),
}


def build(family: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(
            family,
            vocab_size=VOCAB,
            max_position_embeddings=8192,
            pad_token_id=0,
            tie_word_embeddings=False,
            **SHAPES[family],
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    backend = resolve_backend("auto", torch.device("cpu"), torch.float32, AttentionNeeds.of(config))
    wrapped = prepare_model(model, backend)
    wrapped.use_loss(LossConfig().impl)
    return wrapped


def padded_batch(tokens: list[torch.Tensor]) -> Batch:
    width = max(len(t) for t in tokens)
    ids = torch.zeros(len(tokens), width, dtype=torch.long)
    labels = torch.full((len(tokens), width), IGNORE_INDEX)
    mask = torch.zeros(len(tokens), width, dtype=torch.long)
    for i, t in enumerate(tokens):
        ids[i, : len(t)], labels[i, 1 : len(t)], mask[i, : len(t)] = t, t[1:], 1
    return Batch(
        input_ids=ids,
        labels=labels,
        position_ids=torch.arange(width).expand(len(tokens), -1).clone(),
        attention_mask=mask,
        num_examples=len(tokens),
    )


def batches(lengths: np.ndarray, budget: int, n_bins: int, seed: int):
    """(packed, padded, one by one) micro-batches of the same examples."""
    rng = np.random.default_rng(seed)
    bins = pack_best_fit_decreasing(lengths, budget, None, rng)
    picked = [bins[i] for i in rng.choice(len(bins), size=min(n_bins, len(bins)), replace=False)]
    g = torch.Generator().manual_seed(seed)
    tokens = {int(i): torch.randint(3, VOCAB, (int(lengths[i]),), generator=g) for b in picked for i in b}
    packed = [packed_batch([tokens[int(i)] for i in b]) for b in picked]
    chosen = np.array(sorted(tokens))
    per_batch = max(1, round(len(lengths) / len(bins)))
    padded = [padded_batch([tokens[int(chosen[j])] for j in b]) for b in batch_padded(len(chosen), per_batch, rng)]
    alone = [padded_batch([tokens[i]]) for i in tokens]
    return packed, padded, alone


def step_pass(model, micro_batches: list[Batch]):
    def run():
        for b in micro_batches:
            model.token_loss(**b.model_inputs(), labels=b.labels).backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(SHAPES), default="qwen3_next")
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--bins", type=int, default=3, help="packed micro-batches timed per workload")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--examples", type=int, default=20000, help="lengths drawn per workload")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.family)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"torch {torch.__version__}, {args.threads} thread(s) | {args.family}-shaped, {params:.1f}M parameters | "
        f"budget {args.budget}, {args.bins} packed micro-batches, median of {args.reps}"
    )
    header = (
        f"{'workload':>16} | {'useful':>7} {'pad %':>5} | {'one by one':>10} {'padded':>8} {'packed':>8} | "
        f"{'packed/padded':>13}"
    )
    print(header + "\n" + "-" * len(header), flush=True)
    for name, draw in WORKLOADS.items():
        lengths = np.minimum(draw(args.examples, seed=1), args.budget)
        packed, padded, alone = batches(lengths, args.budget, args.bins, seed=2)
        useful = sum(int((b.labels != IGNORE_INDEX).sum()) for b in packed)
        pad = 1 - sum(int(b.attention_mask.sum()) for b in padded) / sum(b.attention_mask.numel() for b in padded)
        seconds = median_times([step_pass(model, x) for x in (alone, padded, packed)], args.reps, time.process_time)
        rates = [useful / s for s in seconds]
        print(
            f"{name:>16} | {useful:>7} {100 * pad:>5.1f} | {rates[0]:>10,.0f} {rates[1]:>8,.0f} {rates[2]:>8,.0f} | "
            f"{rates[2] / rates[1]:>13.2f}",
            flush=True,
        )
    print("useful tokens per CPU second, forward + backward")


if __name__ == "__main__":
    main()
