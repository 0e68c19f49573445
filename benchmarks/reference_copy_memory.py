"""What making the frozen DPO reference costs in host memory at setup (``trainer.objectives.reference.frozen_copy``,
the policy still whole on every rank): ``python benchmarks/reference_copy_memory.py [--layers 12 --width 768]``.

Two ways to copy a GPT-2 (default: GPT-2 small, 124M parameters, fp32) into a bf16 reference, each in a process
of its own, RSS sampled every millisecond while copying:
- ``deepcopy then cast``: ``copy.deepcopy`` of the fp32 policy, then every parameter cast (two fp32 models at once);
- ``frozen_copy``: packfsdp's, each parameter cast as it is copied.
Figures: docs/dpo.md (the references).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.figures import captured, markdown_argument, publish


def measure(way: str, layers: int, width: int) -> dict:
    import psutil
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer.objectives.reference import frozen_copy

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64, vocab_size=50257))
    gc.collect()
    proc, done = psutil.Process(), []
    base = proc.memory_info().rss
    top = [base]

    def sample() -> None:
        while not done:
            top[0] = max(top[0], proc.memory_info().rss)
            time.sleep(0.001)

    threading.Thread(target=sample, daemon=True).start()
    if way == "deepcopy then cast":
        reference = copy.deepcopy(model).requires_grad_(False)
        for param in reference.parameters():
            param.data = param.data.to(torch.bfloat16)
    else:
        reference = frozen_copy(model, torch.bfloat16)
    time.sleep(0.05)
    done.append(True)
    held = proc.memory_info().rss - base
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    mib = 2**20
    return {
        "way": way,
        "policy_mib": sum(p.numel() for p in model.parameters()) * 4 / mib,
        "peak_rise_mib": (top[0] - base) / mib,
        "held_mib": held / mib,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--way", help=argparse.SUPPRESS)
    markdown_argument(parser)
    args = parser.parse_args()
    if args.way:
        print(json.dumps(measure(args.way, args.layers, args.width)))
        return
    with captured() as table:
        print(f"GPT-2 {args.layers} layers x {args.width}, copied into a bf16 reference (RSS, MiB):")
        print(f"  {'way':<20} {'fp32 policy':>11} {'peak rise':>10} {'held after':>10}")
        for way in ("deepcopy then cast", "frozen_copy"):
            out = subprocess.run(
                [sys.executable, __file__, "--way", way, "--layers", str(args.layers), "--width", str(args.width)],
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"  {way:<20} {r['policy_mib']:>11.0f} {r['peak_rise_mib']:>10.0f} {r['held_mib']:>10.0f}")
    publish(args.markdown, "benchmarks/reference_copy_memory.py", table.block())


if __name__ == "__main__":
    main()
