"""Where the time of one training step goes: ``torch.profiler`` over the trainer's own ``train_step``.

    python benchmarks/profile_step.py [--model gpt2_4x256] [--threads 2] [key=value ...]

Builds the ``Trainer`` of ``recipe=cpu_dailydialog`` on one process (FSDP2 over a world of 1, fp32, packed
bfd micro-batches of 1024 tokens, the ``--model`` size of ``benchmarks/peer_hf.py``) plus any Hydra overrides
(e.g. ``loss=naive``, ``packing=none``, ``parallel.compile=true``), runs ``--warmup`` steps, profiles
``--steps`` more and prints the top ``--top`` operators by self CPU time. ``--by-caller`` profiles with
Python stacks and also prints the top (caller, operator) pairs, the caller being the innermost frame or
backward node that ``CALLERS`` names (FSDP2, the chunked loss, the attention backend, the optimizer, ...).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


CALLERS = (
    ("torch/distributed/fsdp", "FSDP2"),
    ("trainer/loss.py", "chunked loss"),
    ("trainer/model/backends_sdpa.py", "attention backend"),
    ("trainer/model/packed_layout.py", "packed layout"),
    ("torch/optim", "optimizer"),
    ("clip_grad", "grad clipping"),
    ("autograd::engine::evaluate_function: ", "backward of "),
    ("transformers/", "transformers forward"),
    ("trainer/", "trainer"),
)
"""(substring of an enclosing profiler event, caller label): the innermost enclosing event that contains one
names the caller; a backward node keeps its own name (``backward of MmBackward0``)."""


def caller_of(event) -> str:
    parent = event.cpu_parent
    while parent is not None:
        for needle, label in CALLERS:
            if needle in parent.name:
                return label + parent.name.split(needle, 1)[1] if label.startswith("backward") else label
        parent = parent.cpu_parent
    return "other"


def by_caller(prof, steps: int, top: int) -> None:
    """Top (caller, aten operator) pairs by self CPU time per step."""
    totals: dict[tuple[str, str], float] = {}
    for event in prof.events():
        if event.name.startswith("aten::"):
            key = (caller_of(event), event.name)
            totals[key] = totals.get(key, 0.0) + event.self_cpu_time_total
    grand = sum(totals.values())
    print(f"{'caller':42s} {'operator':28s} {'ms/step':>8s} {'share':>6s}")
    for (caller, op), us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{caller[:42]:42s} {op[:28]:28s} {us / 1000 / steps:8.1f} {100 * us / grand:5.1f}%")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2_4x256")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--by-caller", action="store_true", help="also break operators down by caller (slower)")
    args, overrides = p.parse_known_args(argv)

    import torch
    from hydra import compose, initialize_config_dir
    from torch.profiler import ProfilerActivity, profile

    from peer_hf import SIZES, model_shape
    from trainer.compose import config_dir, register_configs, to_job_config
    from trainer.loop import Trainer

    if args.model not in SIZES:
        p.error(f"--model must be one of {', '.join(SIZES)}")
    torch.set_num_threads(args.threads)
    shape = [f"++model.config_overrides.{k}={v}" for k, v in model_shape(args.model).items()]
    register_configs()
    with initialize_config_dir(str(config_dir()), version_base=None):
        cfg = to_job_config(compose("config", overrides=[
            "recipe=cpu_dailydialog", "grad_accum=1", "parallel=fsdp_fp32", "eval.holdout_fraction=0",
            "logger.peak_tflops=1", "logger.progress_bar=false", "logger.log_every=1000",
            f"max_steps={args.warmup + args.steps + 1}", f"run_dir={tempfile.mkdtemp(prefix='profile-')}",
            *shape, *overrides,
        ]))
    trainer = Trainer(cfg)
    trainer.model.train()
    for _ in range(args.warmup):
        trainer.train_step()
    with profile(activities=[ProfilerActivity.CPU], with_stack=args.by_caller) as prof:
        useful = sum(trainer.train_step().useful_tokens for _ in range(args.steps))
    total_ms = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1000 / args.steps
    print(f"{args.model}, loss {trainer.loss_impl}, {' '.join(overrides) or 'defaults'}: "
          f"{total_ms:.0f} ms of CPU op time per step, {useful / args.steps:.0f} useful tokens per step")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.by_caller:
        by_caller(prof, args.steps, 3 * args.top)


if __name__ == "__main__":
    main()
