"""Packed vs padded on CPU: useful tokens per second, attention alone and the whole tiny model, fwd+bwd.

    PACKFSDP_CACHE=/tmp/pfcache python benchmarks/attention_speed.py [--budgets 1024 2048 4096] [--reps 5]

Data: the generated DailyDialog-like corpus, tokenized with the local BPE (as ``recipe=cpu_dailydialog``).
For each token budget the examples are packed best-fit-decreasing; a few packed micro-batches are timed,
and the *same examples* are timed as the padded baseline builds them (shuffled, as many per micro-batch
as a packed one holds on average, padded to the longest). Useful tokens are tokens that carry a label.

Two measurements per budget, each forward + backward, median over ``--reps`` passes over the batches:
- ``attention``: one layer's attention (q, k, v -> out) with the tiny model's shapes: packed rows through
  ``sdpa_varlen`` / ``sdpa_block_mask`` vs the padded rectangle through SDPA with a causal+padding mask
  (what transformers' ``sdpa`` path builds);
- ``model``: the whole tiny GPT-2 (``configs/model/gpt2_tiny.yaml``) with its loss, through
  ``VarlenCausalLM`` (packed backends vs transformers' padded SDPA path).
Prints useful tokens/s and packed/padded ratios; a ratio below 1.00 means packed is slower per useful token.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.collate import collate_packed, collate_padded
from trainer.config import DataConfig, ModelConfig
from trainer.data import load_dataset, load_tokenizer
from trainer.data.examples import IGNORE_INDEX
from trainer.model import BACKENDS, build_model, resolve_backend
from trainer.packing.strategies import batch_padded, pack_best_fit_decreasing

TINY = dict(n_layer=2, n_embd=128, n_head=4, n_positions=4096, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
HEADS, HEAD_DIM = 4, 32


def median_times(passes: list, reps: int, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Median seconds of each pass by ``clock``; the passes take turns every rep so a busy machine slows all
    alike (``time.process_time`` on one thread: the compute this process did, which other jobs on a shared
    machine do not inflate as they do wall time)."""
    for p in passes:
        p()  # warm-up (allocator, plan caches)
    times = [[] for _ in passes]
    for _ in range(reps):
        for p, t in zip(passes, times, strict=True):
            start = clock()
            p()
            t.append(clock() - start)
    return [statistics.median(t) for t in times]


def make_batches(dataset, budget: int, n_bins: int, seed: int):
    """``n_bins`` packed micro-batches, and padded micro-batches built as the trainer's baseline builds them
    (examples shuffled over the whole dataset, as many per micro-batch as a packed one holds on average,
    padded to the longest) until they hold at least as many useful tokens."""
    rng = np.random.default_rng(seed)
    bins = pack_best_fit_decreasing(dataset.lengths, budget, None, rng)
    picked = [bins[i] for i in rng.choice(len(bins), size=min(n_bins, len(bins)), replace=False)]
    packed = [collate_packed(dataset, b) for b in picked]
    per_batch = max(1, round(len(dataset) / len(bins)))
    padded, useful = [], 0
    for b in batch_padded(len(dataset), per_batch, rng):
        if useful >= sum(p.num_label_tokens for p in packed):
            break
        padded.append(collate_padded(dataset, b, 0))
        useful += padded[-1].num_label_tokens
    return packed, padded


def qkv_for(shape_bt: tuple[int, int], gen: torch.Generator):
    """q, k, v as transformers makes them: ``[B, T, H, D]`` projections viewed as ``[B, H, T, D]``."""
    b, t = shape_bt
    return [torch.randn(b, t, HEADS, HEAD_DIM, generator=gen).transpose(1, 2).requires_grad_() for _ in range(3)]


def attention_pass(packed, padded, backend: str | None, gen) -> callable:
    """A closure running fwd+bwd of attention over all batches (packed through ``backend`` or padded)."""
    module = type("M", (), {"is_causal": True})()
    work = []
    if backend is not None:
        fn = BACKENDS[backend].fn
        for batch in packed:
            q, k, v = qkv_for((1, batch.num_tokens), gen)
            kw = dict(
                cu_seq_lens_q=batch.cu_seqlens,
                cu_seq_lens_k=batch.cu_seqlens,
                max_length_q=batch.max_seqlen,
                max_length_k=batch.max_seqlen,
            )
            work.append(lambda q=q, k=k, v=v, kw=kw: fn(module, q, k, v, None, scaling=HEAD_DIM**-0.5, **kw)[0])
    else:
        for batch in padded:
            q, k, v = qkv_for(tuple(batch.input_ids.shape), gen)
            keep = batch.attention_mask.bool()
            width = keep.shape[1]
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            mask = (causal[None] & keep[:, None, :])[:, None]
            work.append(lambda q=q, k=k, v=v, m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m))

    def run():
        for step in work:
            step().sum().backward()

    return run


def model_pass(model, batches) -> callable:
    def run():
        for batch in batches:
            logits = model(**batch.model_inputs())
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1), batch.labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            loss.backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--bins", type=int, default=4, help="packed micro-batches timed per budget")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="1 by default: on a shared machine, OpenMP threads spinning at barriers turn timings into noise",
    )
    parser.add_argument("--num-dialogs", type=int, default=13118)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    cache = os.environ.get("PACKFSDP_CACHE", str(Path.home() / ".cache" / "packfsdp"))
    data_cfg = DataConfig(num_records=args.num_dialogs, cache_dir=cache)
    model_cfg = ModelConfig(family="gpt2", config_overrides=TINY)
    tokenizer = load_tokenizer(model_cfg, data_cfg)
    dataset = load_dataset(data_cfg, tokenizer, max_length=min(args.budgets))
    models = {
        name: build_model(model_cfg, tokenizer, resolve_backend(name, torch.device("cpu")), seed=0)
        for name in ("sdpa_varlen", "sdpa_block_mask")
    }
    lengths = dataset.lengths
    print(
        f"torch {torch.__version__}, {args.threads} threads | {len(dataset)} examples, length mean "
        f"{lengths.mean():.0f} / max {lengths.max()} | tiny GPT-2 {TINY['n_layer']} layers x {TINY['n_embd']}"
    )
    header = (
        f"{'budget':>6} {'what':>9} | {'useful':>7} {'pad %':>5} | {'padded':>9} {'sdpa_varlen':>11} "
        f"{'block_mask':>10} | {'varlen/pad':>10} {'block/pad':>9}"
    )
    print(header + "\n" + "-" * len(header), flush=True)
    worst = float("inf")
    for budget in args.budgets:
        packed, padded = make_batches(dataset, budget, args.bins, seed=budget)
        useful = [sum(b.num_label_tokens for b in batches) for batches in (padded, packed, packed)]
        pad_frac = 1 - sum(b.num_tokens for b in padded) / sum(b.num_positions for b in padded)
        gen = torch.Generator().manual_seed(budget)
        rows = {
            "attention": [attention_pass(packed, padded, be, gen) for be in (None, "sdpa_varlen", "sdpa_block_mask")],
            "model": [
                model_pass(models["sdpa_varlen"], padded),
                model_pass(models["sdpa_varlen"], packed),
                model_pass(models["sdpa_block_mask"], packed),
            ],
        }
        for what, passes in rows.items():
            rates = [u / t for u, t in zip(useful, median_times(passes, args.reps), strict=True)]
            ratios = [r / rates[0] for r in rates[1:]]
            worst = min(worst, *ratios)
            print(
                f"{budget:>6} {what:>9} | {useful[1]:>7} {100 * pad_frac:>5.1f} | {rates[0]:>9,.0f} {rates[1]:>11,.0f} "
                f"{rates[2]:>10,.0f} | {ratios[0]:>10.2f} {ratios[1]:>9.2f}",
                flush=True,
            )
    print(
        f"useful tokens/s (fwd+bwd); worst packed/padded ratio: {worst:.2f} "
        f"({'packed never slower per useful token' if worst >= 1 else 'PACKED SLOWER SOMEWHERE'})"
    )


if __name__ == "__main__":
    main()
