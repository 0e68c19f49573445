"""How the packing win grows with length variability: ``packfsdp variability [--out DIR]``.

Several example-length distributions with the same mean, from near-constant to heavy-tailed, each as a
synthetic dataset of random tokens. For each, the real packing code builds packed micro-batches (best-fit
decreasing into the token budget) and padded ones (as many examples per micro-batch as a packed one holds on
average, so useful tokens per step match), and the same tiny GPT-2 runs forward + backward + AdamW step on
alternating packed and padded micro-batches (bf16 autocast, one process, one thread by default; each
micro-batch timed twice, the faster counts). The measured speedup (useful
tokens/s, packed / padded) is plotted against the coefficient of variation of the length (std / mean).

Single-process on purpose: it isolates what packing changes (positions computed per useful token) from
the collectives, and runs in a minute or two on a CPU. ``packfsdp compare`` measures the full distributed
run on the real data.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from trainer.collate import collate_packed, collate_padded
from trainer.config import ModelConfig, PackingConfig
from trainer.data.examples import TokenizedDataset
from trainer.loss import summed_token_loss
from trainer.metrics import padding_fraction
from trainer.model import build_model, resolve_backend
from trainer.packing import batch_padded, matched_padded_batch_size, pack_best_fit_decreasing
from trainer.tools.plots import plot_variability

VOCAB = 4096


def length_distributions(mean: int, n: int, max_len: int, seed: int) -> dict[str, np.ndarray]:
    """Lengths of equal mean (to within a token), from near-constant to heavy-tailed."""
    rng = np.random.default_rng(seed)
    raw = {
        "constant": np.full(n, float(mean)) + rng.integers(-2, 3, n),
        "uniform": rng.uniform(0.5 * mean, 1.5 * mean, n),
        "lognormal s=0.5": rng.lognormal(0.0, 0.5, n),
        "lognormal s=0.75": rng.lognormal(0.0, 0.75, n),
        "lognormal s=1.0": rng.lognormal(0.0, 1.0, n),
        "pareto a=1.5": rng.pareto(1.5, n) + 1.0,
    }
    return {name: _with_mean(x, mean, max_len) for name, x in raw.items()}


def _with_mean(x: np.ndarray, mean: float, max_len: int) -> np.ndarray:
    """Scale to ``mean``, clip to ``[2, max_len]``; repeat (clipping moves the mean) until it settles."""
    scale = mean / x.mean()
    for _ in range(50):
        lengths = np.clip(np.rint(x * scale), 2, max_len).astype(np.int64)
        if abs(lengths.mean() - mean) < 0.5:
            break
        scale *= mean / lengths.mean()
    return lengths


def synthetic_dataset(lengths: np.ndarray, seed: int) -> TokenizedDataset:
    rng = np.random.default_rng(seed)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = rng.integers(3, VOCAB, size=int(offsets[-1]), dtype=np.int32)
    return TokenizedDataset(tokens, np.ones(len(tokens), dtype=bool), offsets)


def time_step(model, optimizer, batch, repeats: int = 1) -> float:
    """Seconds of forward + backward + optimizer step; the fastest of ``repeats`` (load bursts on a shared
    machine then inflate neither side)."""
    return min(_one_step(model, optimizer, batch) for _ in range(repeats))


def _one_step(model, optimizer, batch) -> float:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = summed_token_loss(model, batch) / max(batch.num_label_tokens, 1)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def measure(lengths: np.ndarray, model, optimizer, budget: int, steps: int, seed: int) -> dict:
    """Useful tokens/s of packed and padded micro-batches of one length distribution."""
    dataset = synthetic_dataset(lengths, seed)
    rng = np.random.default_rng(seed)
    packing = PackingConfig(strategy="bfd", token_budget=budget)
    packed_bins = pack_best_fit_decreasing(lengths, budget, rng=rng)
    padded_bins = batch_padded(len(lengths), matched_padded_batch_size(lengths, packing, seed), rng)
    packed_pick = rng.choice(len(packed_bins), size=min(steps, len(packed_bins)), replace=False)
    padded_pick = rng.choice(len(padded_bins), size=min(steps, len(padded_bins)), replace=False)
    totals = {"packed": [0, 0.0, 0, 0], "padded": [0, 0.0, 0, 0]}  # useful, seconds, positions, tokens
    warm = [collate_packed(dataset, packed_bins[0]), collate_padded(dataset, padded_bins[0], 0)]
    for batch in warm:
        time_step(model, optimizer, batch)
    for i, j in zip(packed_pick, padded_pick, strict=False):  # alternate so load hits both alike; the shorter ends it
        for name, batch in (
            ("packed", collate_packed(dataset, packed_bins[i])),
            ("padded", collate_padded(dataset, padded_bins[j], 0)),
        ):
            seconds = time_step(model, optimizer, batch, repeats=2)
            t = totals[name]
            t[0] += batch.num_label_tokens
            t[1] += seconds
            t[2] += batch.num_positions
            t[3] += batch.num_tokens
    out = {
        name: {"useful_tokens_per_s": t[0] / t[1], "padding_fraction": padding_fraction(t[3], t[2])}
        for name, t in totals.items()
    }
    return {
        "mean_length": float(lengths.mean()),
        "cv": float(lengths.std() / lengths.mean()),
        "max_length": int(lengths.max()),
        "padded_batch_size": int(len(padded_bins[0])),
        "packed": out["packed"],
        "padded": out["padded"],
        "speedup": out["packed"]["useful_tokens_per_s"] / out["padded"]["useful_tokens_per_s"],
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="packfsdp variability", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="where variability.json/.png go")
    parser.add_argument("--mean", type=int, default=128, help="mean example length in tokens")
    parser.add_argument("--examples", type=int, default=2000, help="examples per distribution")
    parser.add_argument("--budget", type=int, default=1024, help="tokens per packed micro-batch")
    parser.add_argument("--steps", type=int, default=8, help="timed micro-batches per mode and distribution")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: like one rank under torchrun)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out or Path("outputs") / "variability" / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    cfg = ModelConfig(
        family="gpt2",
        config_overrides=dict(
            n_layer=2,
            n_embd=128,
            n_head=4,
            n_positions=args.budget,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            vocab_size=VOCAB,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
    )
    tokenizer = _SizeOnlyTokenizer()
    model = build_model(cfg, tokenizer, resolve_backend("auto", torch.device("cpu")), args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    rows = []
    for name, lengths in length_distributions(args.mean, args.examples, args.budget, args.seed).items():
        row = {"name": name} | measure(lengths, model, optimizer, args.budget, args.steps, args.seed)
        rows.append(row)
        print(
            f"{name:16s} mean {row['mean_length']:6.1f}  CV {row['cv']:.2f}  max {row['max_length']:4d}  "
            f"padded {row['padded']['useful_tokens_per_s']:8,.0f}  packed {row['packed']['useful_tokens_per_s']:8,.0f}"
            f" useful tok/s  speedup {row['speedup']:.2f}x  (padding {100 * row['padded']['padding_fraction']:.0f}%)",
            flush=True,
        )
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__} | vars(args) | {"out": str(out)}
    (out / "variability.json").write_text(json.dumps({"settings": meta, "rows": rows}, indent=2))
    (out / "variability.md").write_text(markdown_table(rows, args.mean))
    plot_variability(rows, out / "variability.png")
    print(f"wrote {out / 'variability.png'}, {out / 'variability.json'} and {out / 'variability.md'}")
    return rows


def markdown_table(rows: list[dict], mean: int) -> str:
    """The measurement as the markdown table docs/measuring.md shows (``variability.md`` beside the json)."""
    lines = [
        f"| lengths (mean {mean}) | CV | padded padding | padded useful tokens/s | packed | speedup |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['cv']:.2f} | {100 * r['padded']['padding_fraction']:.0f}% | "
            f"{r['padded']['useful_tokens_per_s']:,.0f} | {r['packed']['useful_tokens_per_s']:,.0f} | "
            f"{r['speedup']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


class _SizeOnlyTokenizer:
    """What ``build_model`` reads from a tokenizer: its size and special ids (random tokens need no more)."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __len__(self) -> int:
        return VOCAB


if __name__ == "__main__":
    main()
