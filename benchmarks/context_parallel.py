"""Context parallelism, measured: one long packed row sharded over cp ranks (CPU, gloo).

    python benchmarks/context_parallel.py [--tokens 8192] [--layers 8] [--cp 1 2 4] [--steps 2]

For each cp it launches ``torchrun --nproc_per_node cp`` of this file's worker: a Qwen2-shaped model (~30M
parameters at the defaults: hidden 512, 8 layers, 8 query / 2 key-value heads, vocab 8192, random init,
fp32) trains on one row of ``--tokens`` tokens (a long-tailed mix: one example of half the row, the rest
in shorter ones) sharded with ``trainer.parallel.cp_layout`` (balanced split). Each rank reports the activations
autograd saves for backward in its forward (each storage once) and its peak resident memory, its
useful tokens/s (the label tokens it holds / step time), the group's attention-cost skew of both splits
and the bytes of K/V each rank receives per layer (all-gather forward; the backward's reduce-scatter
sends as many). The model is replicated per rank (no FSDP): only the context-parallel part is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from benchmarks.figures import captured, markdown_argument, publish  # noqa: E402


def row_lengths(tokens: int) -> list[int]:
    """A long-tailed row: half one example, a quarter in two, the rest in 16 short ones."""
    long, mid = tokens // 2, tokens // 8
    rest = tokens - long - 2 * mid
    short = [rest // 16] * 16
    short[-1] += rest - sum(short)
    return [long, mid, mid, *short]


def worker(args) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.collate import collate_packed
    from trainer.model import VarlenCausalLM, resolve_backend
    from trainer.parallel.cp_layout import attention_cost, shard_batch
    from trainer.parallel.route import new_cp_group

    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=args.tokens,
        tie_word_embeddings=False,
    )
    model = VarlenCausalLM(Qwen2ForCausalLM(config).float(), resolve_backend("sdpa_varlen", torch.device("cpu")))
    group = new_cp_group(cp, cp, rank) if cp > 1 else None
    lengths = row_lengths(args.tokens)

    rng = np.random.default_rng(0)
    tokens = [rng.integers(1, 8192, n) for n in lengths]

    class Row:
        def example(self, i):
            return tokens[i], np.ones(len(tokens[i]), dtype=bool)

    row = collate_packed(Row(), np.arange(len(lengths)))
    batch = shard_batch(row, cp, rank, "balanced", group, "sdpa_varlen") if cp > 1 else row
    saved: dict[int, int] = {}

    def pack(t):  # activations autograd keeps for backward, each storage once
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    times = []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        saved.clear()
        dist.barrier()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model.token_loss(**batch.model_inputs(), labels=batch.labels)
        activations = sum(saved.values())
        loss.backward()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step = min(times)
    slots = batch.input_ids.shape[1]
    kv_bytes = 2 * (cp - 1) * slots * config.num_key_value_heads * (config.hidden_size // 8) * 4
    out = torch.tensor([activations / 2**20, peak / 2**10, batch.num_label_tokens / step, step], dtype=torch.float64)
    gathered = [torch.zeros_like(out) for _ in range(cp)]
    dist.all_gather(gathered, out)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        result = {
            "cp": cp,
            "tokens": args.tokens,
            "params_m": params / 1e6,
            "activations_mib_per_rank": max(float(g[0]) for g in gathered),
            "peak_rss_mib_per_rank": max(float(g[1]) for g in gathered),
            "useful_tokens_per_s_per_rank": float(np.mean([float(g[2]) for g in gathered])),
            "step_s": max(float(g[3]) for g in gathered),
            "skew_contiguous": float((c := attention_cost(lengths, cp, "contiguous")).max() / c.mean() - 1),
            "skew_balanced": float((b := attention_cost(lengths, cp, "balanced")).max() / b.mean() - 1),
            "kv_bytes_received_per_layer": kv_bytes,
        }
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    markdown_argument(parser)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    for cp in args.cp:
        out = Path(f"/tmp/packfsdp_cp_bench_{os.getpid()}_{cp}.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={cp}",
            __file__,
            "--worker",
            "--out",
            str(out),
            "--tokens",
            str(args.tokens),
            "--layers",
            str(args.layers),
            "--steps",
            str(args.steps),
        ]
        env = os.environ | {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // cp)), "PYTHONPATH": str(REPO)}
        subprocess.run(cmd, check=True, env=env, cwd=REPO)
        rows.append(json.loads(out.read_text()))
        out.unlink()
    with captured() as table:
        print(
            "| cp | params | row tokens | activations saved / rank (MiB) | peak RSS / rank (MiB) | "
            "useful tok/s / rank | step (s) | skew contiguous | skew balanced | K/V bytes received / rank / layer |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['cp']} | {r['params_m']:.1f}M | {r['tokens']} | {r['activations_mib_per_rank']:.0f} | "
                f"{r['peak_rss_mib_per_rank']:.0f} | "
                f"{r['useful_tokens_per_s_per_rank']:.0f} | {r['step_s']:.2f} | {100 * r['skew_contiguous']:.1f}% | "
                f"{100 * r['skew_balanced']:.1f}% | {r['kv_bytes_received_per_layer'] / 2**20:.2f} MiB |"
            )
    publish(args.markdown, "benchmarks/context_parallel.py", table.text())


if __name__ == "__main__":
    main()
