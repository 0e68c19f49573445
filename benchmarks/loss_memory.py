"""Peak memory of one training step, naive vs chunked loss, at Qwen2.5's vocabulary.

    python benchmarks/loss_memory.py [--budget 8192] [--vocab 151936] [--impls naive chunked]

A tiny Qwen2 (2 layers, width 64, tied head, random init) with Qwen2.5's vocabulary (151,936), fp32 on CPU,
one packed micro-batch of ``--budget`` tokens (8 examples, every token a label): forward, backward and an
AdamW step through ``VarlenCausalLM`` and ``summed_token_loss``, as the trainer runs them. Each loss
implementation runs in its own process, one after the other, so their peaks never mix; the peak is the
process's peak resident set size (``ru_maxrss``). Printed per implementation: the peak, the resident size
before the step (model, optimizer state, batch) and the step's own share (the difference); then the ratio of
the peaks (goal: chunked <= 1/4 of naive) and of the step's own shares.

Where naive's memory goes (fp32 logits ``[T, V]`` = T * V * 4 bytes; 5.0 GB at T = 8,192, V = 151,936):
the logits, log-softmax's saved output, and in backward the gradient of each -- about four such tensors alive
at the peak. The chunked loss holds the logits of one chunk (``2**25`` logits, 128 MiB) and the gradients of
the hidden states and head weight, never ``[T, V]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.figures import captured, markdown_argument, publish  # noqa: E402

QWEN25_VOCAB = 151_936
MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
GIB = 2**30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=int, default=8192, help="tokens in the packed micro-batch")
    p.add_argument("--vocab", type=int, default=QWEN25_VOCAB, help="vocabulary size (Qwen2.5: 151,936)")
    p.add_argument("--examples", type=int, default=8, help="examples packed into the micro-batch")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--impls", nargs="+", default=["naive", "chunked"], choices=["naive", "chunked"])
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    markdown_argument(p)
    return p.parse_args(argv)


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args: argparse.Namespace) -> dict:
    import time

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.collate import Batch
    from trainer.loss import summed_token_loss
    from trainer.model import VarlenCausalLM, resolve_backend

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", vocab_size=args.vocab, **MODEL)
    model = VarlenCausalLM(
        AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"),
        resolve_backend("sdpa_varlen", torch.device("cpu")),
    )
    line = model.use_loss(args.worker)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    length = args.budget // args.examples
    ids = torch.randint(0, args.vocab, (1, length * args.examples))
    cu = torch.arange(0, length * args.examples + 1, length, dtype=torch.int32)
    labels = ids.clone()
    labels[0, cu[:-1].long()] = -100  # each example's first token has no label
    batch = Batch(ids, labels, torch.arange(length).repeat(args.examples)[None], cu, length)
    for p in model.parameters():  # AdamW's state exists from the first step: allocate it up front
        optimizer.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    before = current_rss_bytes()
    start = time.perf_counter()
    loss = summed_token_loss(model, batch)
    (loss / int((labels != -100).sum())).backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    peak = rss_peak_bytes()
    return {
        "impl": line,
        "peak_rss_gib": peak / GIB,
        "before_step_gib": before / GIB,
        "step_gib": (peak - before) / GIB,
        "loss": float(loss),
        "step_s": seconds,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return {}
    with captured() as out:
        print(
            f"loss memory: tiny Qwen2 (2 layers, width 64), vocab {args.vocab:,}, {args.budget:,} tokens, fp32 CPU, "
            f"one training step per process"
        )
        results = {}
        for impl in args.impls:
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                impl,
                "--budget",
                str(args.budget),
                "--vocab",
                str(args.vocab),
                "--examples",
                str(args.examples),
                "--threads",
                str(args.threads),
            ]
            env = os.environ | {"OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{impl:8s} FAILED (exit {proc.returncode}; killed for memory if -9):\n{proc.stderr[-2000:]}")
                continue
            r = results[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(
                f"{r['impl']:16s} peak RSS {r['peak_rss_gib']:6.2f} GiB | "
                f"before the step {r['before_step_gib']:5.2f} GiB | the step's own {r['step_gib']:6.2f} GiB | "
                f"{r['step_s']:5.1f} s | loss {r['loss']:.1f}",
                flush=True,
            )
        if {"naive", "chunked"} <= results.keys():
            naive, chunked = results["naive"], results["chunked"]
            ratio = chunked["peak_rss_gib"] / naive["peak_rss_gib"]
            print(
                f"chunked / naive peak RSS: {ratio:.3f} (goal <= 0.25: {'met' if ratio <= 0.25 else 'NOT met'}) | "
                f"the step's own memory: {chunked['step_gib'] / naive['step_gib']:.3f} | "
                f"same loss: {abs(chunked['loss'] - naive['loss']) <= 1e-5 * abs(naive['loss'])}"
            )
    publish(args.markdown, "benchmarks/loss_memory.py", out.block(), args.threads, argv)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"settings": vars(args) | {"json": str(args.json), "markdown": str(args.markdown)}, "results": results},
                indent=2,
            )
        )
    return results


if __name__ == "__main__":
    main()
