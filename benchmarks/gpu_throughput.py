"""Packed vs padded training throughput of GPT-2 124M (random init, bf16) on one GPU.

    python benchmarks/gpu_throughput.py [--budget 8192] [--steps 10] [--backends auto sdpa_varlen]

Example lengths follow the generated DailyDialog-like corpus (mean ~125 tokens, long tail) drawn from a
seeded log-normal, token ids are random (the vocabulary is GPT-2's 50257). Packed micro-batches come from
best-fit-decreasing at ``--budget`` tokens; the padded baseline takes as many examples per micro-batch as a
packed one holds on average, shuffled, padded to the longest, through transformers' SDPA with a mask.
Each configuration runs ``--warmup`` then ``--steps`` optimizer steps (forward, backward, AdamW) and prints
useful tokens/s (tokens with a label), padding fraction and peak memory. Needs no network and no data.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.collate import IGNORE_INDEX  # noqa: E402
from trainer.model import VarlenCausalLM, resolve_backend  # noqa: E402
from trainer.packing.strategies import batch_padded, pack_best_fit_decreasing  # noqa: E402

VOCAB = 50257


def make_lengths(n: int, max_len: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=4.6, sigma=0.6, size=n).astype(np.int64), 8, max_len)


def packed_batch(lengths, idx, device, gen):
    lens = lengths[idx]
    ids = torch.randint(0, VOCAB, (1, int(lens.sum())), generator=gen).to(device)
    labels = ids.clone()
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.from_numpy(np.cumsum(lens))
    labels[0, cu[:-1].long()] = IGNORE_INDEX
    pos = torch.cat([torch.arange(n) for n in lens])[None].to(device)
    inputs = dict(input_ids=ids, position_ids=pos, cu_seqlens=cu.to(device), max_seqlen=int(lens.max()))
    return inputs, labels, int(lens.sum() - len(lens)), int(lens.sum())


def padded_batch(lengths, idx, device, gen):
    lens = lengths[idx]
    width = int(lens.max())
    ids = torch.randint(0, VOCAB, (len(lens), width), generator=gen)
    keep = torch.arange(width)[None] < torch.from_numpy(lens)[:, None]
    labels = ids.masked_fill(~keep, IGNORE_INDEX)
    labels[:, 0] = IGNORE_INDEX
    pos = torch.arange(width).expand(len(lens), width)
    inputs = dict(input_ids=ids.to(device), position_ids=pos.to(device), attention_mask=keep.long().to(device))
    return inputs, labels.to(device), int(lens.sum() - len(lens)), len(lens) * width


def run(model, batches, steps: int, warmup: int) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    torch.cuda.reset_peak_memory_stats()
    useful = positions = 0
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        inputs, labels, n_useful, n_pos = batches[step % len(batches)]
        logits = model(**inputs)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                               ignore_index=IGNORE_INDEX)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            useful += n_useful
            positions += n_pos
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"useful_tok_s": useful / elapsed, "positions": positions, "useful": useful,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "step_ms": 1000 * elapsed / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["auto", "sdpa_varlen"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_throughput: needs a CUDA GPU")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True

    lengths = make_lengths(20000, 1024, seed=0)
    rng = np.random.default_rng(0)
    bins = pack_best_fit_decreasing(lengths, args.budget, None, rng)
    per_batch = max(1, round(len(lengths) / len(bins)))
    n = args.warmup + args.steps
    gen = torch.Generator().manual_seed(0)
    packed = [packed_batch(lengths, b, device, gen) for b in bins[:n]]
    padded = [padded_batch(lengths, b, device, gen) for b in batch_padded(len(lengths), per_batch, rng)[:n]]

    config = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_positions=1024, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).to(device)
    base.config.use_cache = False
    print(f"{torch.cuda.get_device_name()} | GPT-2 {sum(p.numel() for p in base.parameters()) / 1e6:.0f}M random "
          f"init, bf16 | budget {args.budget}, {per_batch} examples per padded micro-batch, {args.steps} steps")
    results = {}
    for name in args.backends:
        try:
            backend = resolve_backend(name, device, torch.bfloat16)
        except Exception as e:  # report, keep going: this is a check script
            print(f"  packed {name:<16} cannot run: {e}")
            continue
        results[f"packed {backend.name}"] = run(VarlenCausalLM(base, backend), packed, args.steps, args.warmup)
    results["padded sdpa"] = run(VarlenCausalLM(base, resolve_backend("sdpa_varlen", device)), padded,
                                 args.steps, args.warmup)
    ref = results["padded sdpa"]["useful_tok_s"]
    for name, r in results.items():
        pad = 1 - r["useful"] / r["positions"]
        print(f"  {name:<24} useful tok/s {r['useful_tok_s']:>10,.0f}  x{r['useful_tok_s'] / ref:5.2f} vs padded | "
              f"step {r['step_ms']:7.1f} ms | non-label positions {100 * pad:4.1f}% | peak {r['peak_gib']:.1f} GiB")


if __name__ == "__main__":
    main()
