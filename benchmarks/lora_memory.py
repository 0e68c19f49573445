"""Full fine-tuning vs LoRA on the CPU chat recipe: peak memory and useful tokens/s (a script, not a test).

    python benchmarks/lora_memory.py [--steps 8] [--nproc 2] [--sizes recipe,wide] [--json F]

Each (size, mode) is one real 2-rank training run (``torchrun -m trainer.train recipe=cpu_chat_lora``) in
a temporary run directory: ``lora`` as the recipe ships it, ``full`` the same run with ``peft=none`` (every
weight trained, as ``cpu_chat_sft``). ``recipe`` is the recipe's tiny Qwen2 (0.2M parameters: its figures
are dominated by the Python process); ``wide`` widens it to hidden 256 x 4 layers (~3M) so that the
weights, gradients and AdamW state weigh something, with fp32 compute (``parallel.param_dtype=float32``: bf16
matmuls on a CPU without bf16 units run ~10x slower). Figures come from each run's ``summary.json``: useful
tokens/s averaged after the warm-up steps and peak memory (peak resident set size of a rank on CPU, the
CUDA allocator's peak on GPU), plus the trainable parameter count the run logged and, computed from the
counts, the bytes of fp32 weights + gradients + AdamW moments (what LoRA saves; on CPU the process's own
resident memory hides it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.figures import captured, markdown_argument, publish

REPO = Path(__file__).resolve().parents[1]
SIZES = {
    "recipe": [],
    "wide": [
        "++model.random_init.hidden_size=256",
        "++model.random_init.intermediate_size=512",
        "++model.random_init.num_hidden_layers=4",
        "++model.random_init.num_attention_heads=4",
        "++model.random_init.num_key_value_heads=2",
        "parallel.param_dtype=float32",
    ],
}
MODES = {"full": ["peft=none"], "lora": []}
QUICK = [
    "data.limit=400",
    "data.num_records=400",
    "optim.warmup_steps=1",
    "logger.peak_tflops=1",
    "logger.progress_bar=false",
    "checkpoint.at_end=false",
    "eval.holdout_fraction=0",
]


def run(size: str, mode: str, steps: int, nproc: int, root: Path) -> dict:
    run_dir = root / f"{size}-{mode}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "trainer.train",
        "recipe=cpu_chat_lora",
        f"max_steps={steps}",
        f"run_dir={run_dir}",
        *QUICK,
        *SIZES[size],
        *MODES[mode],
    ]
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{size}/{mode} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    trainable = re.search(r"LoRA: (\d+) trainable parameters of (\d+)", proc.stderr + proc.stdout)
    params = int(trainable.group(2)) if trainable else summary["model_params"]
    trainable_params = int(trainable.group(1)) if trainable else params
    return {
        "size": size,
        "mode": mode,
        "params": params,
        "trainable_params": trainable_params,
        # fp32 weights, plus a gradient and AdamW's two moments per trainable weight (all ranks together)
        "state_mib": (4 * params + 12 * trainable_params) / 2**20,
        "useful_tokens_per_s": summary["useful_tokens_per_s"],
        "peak_mem_gib": summary["peak_mem_gib"],
        "final_loss": summary["final_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes", default="recipe,wide")
    parser.add_argument("--json", type=Path, default=None)
    markdown_argument(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(size, mode, args.steps, args.nproc, Path(tmp)) for size in args.sizes.split(",") for mode in MODES]
    with captured() as table:
        print(
            "| model | mode | trainable / all params | useful tokens/s | peak memory (GiB, per rank) | "
            "weights + grads + AdamW (MiB, computed) |"
        )
        print("|---|---|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['size']} | {r['mode']} | {r['trainable_params']:,} / {r['params']:,} | "
                f"{r['useful_tokens_per_s']:.0f} | {r['peak_mem_gib']:.3f} | {r['state_mib']:.1f} |"
            )
    publish(args.markdown, "benchmarks/lora_memory.py", table.text())
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
