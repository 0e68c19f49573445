"""Packed vs padded training throughput of GPT-2 124M (random init, bf16) on one GPU.

    python benchmarks/gpu_throughput.py [--budget 8192] [--steps 10] [--backends auto sdpa_varlen] [--json F]
    python benchmarks/gpu_throughput.py --model qwen2.5-0.5b --budget 16384   # Qwen2.5-0.5B's shape, GQA 14:2
    python benchmarks/gpu_throughput.py --device cpu --model tiny --steps 1 --warmup 0 --backends sdpa_varlen

Example lengths follow the generated DailyDialog-like corpus (mean ~125 tokens, long tail) drawn from a
seeded log-normal, token ids are random (the vocabulary is GPT-2's 50257). Both sides see the micro-batches
a one-rank training run would: the packed ones are the first of the sampler's shuffled epoch plan for
``packing.strategy=bfd`` at ``--budget`` tokens, the padded ones the first of ``packing.strategy=none``
(shuffled, as many examples per micro-batch as a packed one holds on average, padded to the longest,
through transformers' SDPA with a mask; where that micro-batch does not fit in memory, the same examples
accumulated over 2, 4, ... row-slices, each padded to its own longest, and the line says so); see
``sample_microbatches``. Taking the first bins of
best-fit-decreasing instead would time its longest examples (a dozen per bin, against ~65 on average).
Each configuration runs ``--warmup`` then ``--steps`` optimizer steps (forward, backward, AdamW) and prints
useful tokens/s (tokens with a label), padding fraction and peak memory. A configuration that fails is
recorded with its error line and the others still run. Needs no network and no data. ``--device cpu
--model tiny`` checks the plumbing without a GPU (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import PackingConfig
from trainer.data.examples import IGNORE_INDEX
from trainer.model import VarlenCausalLM, resolve_backend
from trainer.packing import build_sampler

MODELS = {
    "gpt2": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, attn_pdrop=0.0),  # GPT-2 124M
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_dropout=0.0,
    ),  # Qwen2.5-0.5B's shape (494M), random init
    "tiny": dict(
        model_type="gpt2",
        vocab_size=512,
        n_positions=1024,
        attn_pdrop=0.0,
        n_layer=2,
        n_embd=64,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    ),  # plumbing checks on CPU
}
MAX_EXAMPLE_LENGTH = 1024
"""GPT-2's context: the trainer clamps examples to it (and to the budget)."""


def make_lengths(n: int, max_len: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=4.6, sigma=0.6, size=n).astype(np.int64), 8, max_len)


def sample_microbatches(lengths: np.ndarray, strategy: str, budget: int, count: int, seed: int) -> list[np.ndarray]:
    """The first ``count`` micro-batches (example indices) a one-rank training run with
    ``packing.strategy=strategy`` and ``packing.token_budget=budget`` trains on: the training sampler's
    shuffled epoch plan (``trainer.packing.build_sampler``), which also matches a padded strategy's batch
    size to the packed run."""
    sampler = build_sampler(
        lengths, PackingConfig(balance="tokens", strategy=strategy, token_budget=budget), 0, 1, seed
    )
    return [sampler.next_microbatch()[1] for _ in range(count)]


def packed_batch(lengths, idx, device, gen, vocab: int):
    lens = lengths[idx]
    ids = torch.randint(0, vocab, (1, int(lens.sum())), generator=gen).to(device)
    labels = ids.clone()
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.from_numpy(np.cumsum(lens))
    labels[0, cu[:-1].long()] = IGNORE_INDEX
    pos = torch.cat([torch.arange(n) for n in lens])[None].to(device)
    inputs = dict(input_ids=ids, position_ids=pos, cu_seqlens=cu.to(device), max_seqlen=int(lens.max()))
    return inputs, labels, int(lens.sum() - len(lens)), int(lens.sum())


def padded_batch(lengths, idx, device, gen, vocab: int):
    lens = lengths[idx]
    width = int(lens.max())
    ids = torch.randint(0, vocab, (len(lens), width), generator=gen)
    keep = torch.arange(width)[None] < torch.from_numpy(lens)[:, None]
    labels = ids.masked_fill(~keep, IGNORE_INDEX)
    labels[:, 0] = IGNORE_INDEX
    pos = torch.arange(width).expand(len(lens), width)
    inputs = dict(input_ids=ids.to(device), position_ids=pos.to(device), attention_mask=keep.long().to(device))
    return inputs, labels.to(device), int(lens.sum() - len(lens)), len(lens) * width


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def split_rows(batch: list, pieces: int) -> list:
    """One padded micro-batch (a list of one piece) as ``pieces`` row-slices, each padded to its own longest
    row: the same examples in one optimizer step through gradient accumulation, as a padded trainer whose
    batch does not fit in memory would run it."""
    ((inputs, labels, _, _),) = batch
    rows = labels.shape[0]
    out = []
    for part in torch.arange(rows).tensor_split(min(pieces, rows)):
        mask = inputs["attention_mask"][part]
        width = int(mask.sum(1).max())
        sliced = {k: v[part, :width] for k, v in inputs.items()}
        n_useful = int((labels[part, :width] != IGNORE_INDEX).sum())
        out.append((sliced, labels[part, :width], n_useful, len(part) * width))
    return out


def run(model, batches, steps: int, warmup: int, device: torch.device, pieces: int = 1) -> dict:
    """Time ``steps`` optimizer steps (one micro-batch each, as ``pieces`` accumulated row-slices where more than
    one: ``split_rows``, cut before the clock starts) after ``warmup`` untimed ones."""
    steps_parts = [split_rows([b], pieces) if pieces > 1 else [b] for b in batches]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    useful = positions = 0
    for step in range(warmup + steps):
        if step == warmup:
            synchronize(device)
            start = time.perf_counter()
        parts = steps_parts[step % len(steps_parts)]
        step_useful = sum(part[2] for part in parts)
        for inputs, labels, n_useful, n_pos in parts:
            logits = model(**inputs)
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(),
                labels[:, 1:].flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            (loss / step_useful).backward()
            if step >= warmup:
                useful += n_useful
                positions += n_pos
        opt.step()
        opt.zero_grad(set_to_none=True)
    synchronize(device)
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {
        "useful_tok_s": useful / elapsed,
        "positions": positions,
        "useful": useful,
        "peak_gib": peak,
        "step_ms": 1000 * elapsed / steps,
        "pieces": pieces,
    }


def run_padded(model, batches, steps: int, warmup: int, device: torch.device, max_pieces: int = 64) -> dict:
    """The padded baseline, its micro-batch whole if it fits in memory, else accumulated over 2, 4, ... pieces
    (``split_rows``): a padded run that does not fit is measured the way its user would run it."""
    pieces = 1
    while True:
        try:
            return run(model, batches, steps, warmup, device, pieces)
        except torch.OutOfMemoryError:
            if pieces >= max_pieces:
                raise
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        pieces *= 2


def run_isolated(cases: dict[str, Callable[[], dict]]) -> dict[str, dict]:
    """Each case's figures, or ``{"error": "Type: first line"}`` where it raised: one backend that cannot
    run (missing kernel, out of memory, a compile error) is recorded and the others still run."""
    results = {}
    for label, measure in cases.items():
        try:
            results[label] = measure()
        except Exception as e:  # noqa: BLE001 -- a check script reports every failure and goes on
            first_line = next(iter(str(e).splitlines()), "")
            results[label] = {"error": f"{type(e).__name__}: {first_line}"}
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # an out-of-memory case must not starve the next one
    return results


def format_results(results: dict[str, dict], reference: str) -> list[str]:
    """One table line per case; speed-ups are against ``reference`` when it ran."""
    ref = results.get(reference, {}).get("useful_tok_s")
    lines = []
    for label, r in results.items():
        if "error" in r:
            lines.append(f"  {label:<24} error: {r['error']}")
            continue
        pad = 1 - r["useful"] / r["positions"]
        ratio = f"x{r['useful_tok_s'] / ref:5.2f} vs padded" if ref else "(no padded reference)"
        peak = f"{r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else "n/a"
        pieces = f" | {r['pieces']} pieces accumulated (whole: out of memory)" if r.get("pieces", 1) > 1 else ""
        lines.append(
            f"  {label:<24} useful tok/s {r['useful_tok_s']:>10,.0f}  {ratio} | step "
            f"{r['step_ms']:7.1f} ms | non-label positions {100 * pad:4.1f}% | peak {peak}{pieces}"
        )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["auto", "sdpa_varlen"])
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: a plumbing check (float32), its figures mean nothing",
    )
    parser.add_argument("--model", choices=list(MODELS), default="gpt2")
    parser.add_argument("--examples", type=int, default=20000)
    parser.add_argument("--json", type=Path, help="also write the results (errors included) here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_throughput: needs a CUDA GPU (or --device cpu for a plumbing check)")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = True

    spec = MODELS[args.model]
    lengths = make_lengths(args.examples, min(MAX_EXAMPLE_LENGTH, args.budget), seed=0)
    n = args.warmup + args.steps
    gen = torch.Generator().manual_seed(0)
    packed = [
        packed_batch(lengths, b, device, gen, spec["vocab_size"])
        for b in sample_microbatches(lengths, "bfd", args.budget, n, seed=0)
    ]
    padded_bins = sample_microbatches(lengths, "none", args.budget, n, seed=0)
    padded = [padded_batch(lengths, b, device, gen, spec["vocab_size"]) for b in padded_bins]

    torch.manual_seed(0)
    config = AutoConfig.for_model(**spec)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)
    base.config.use_cache = False
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(
        f"{device_name} | {args.model} {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M random init, "
        f"{dtype} | budget {args.budget}, {len(padded_bins[0])} examples per padded micro-batch, {args.steps} steps"
    )

    def packed_case(name: str) -> Callable[[], dict]:
        def measure() -> dict:
            backend = resolve_backend(name, device, dtype)
            return {"backend": backend.name} | run(
                VarlenCausalLM(base, backend), packed, args.steps, args.warmup, device
            )

        return measure

    cases = {f"packed {name}": packed_case(name) for name in args.backends}
    cases["padded sdpa"] = lambda: run_padded(
        VarlenCausalLM(base, resolve_backend("sdpa_varlen", device)), padded, args.steps, args.warmup, device
    )
    results = run_isolated(cases)
    print("\n".join(format_results(results, "padded sdpa")))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"device": device_name, "args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2
            )
        )
    return results


if __name__ == "__main__":
    main()
