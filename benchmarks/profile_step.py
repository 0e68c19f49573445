"""Where the time of one training step goes: ``torch.profiler`` over the trainer's own ``train_step``.

    python benchmarks/profile_step.py [--model gpt2_4x256] [--threads 2] [key=value ...]

Builds the ``Trainer`` of ``recipe=cpu_dailydialog`` on one process (FSDP2 over a world of 1, fp32, packed
bfd micro-batches of 1024 tokens, the ``--model`` size of ``benchmarks/peer_hf.py``) plus any Hydra overrides
(e.g. ``loss=naive``, ``packing=none``, ``parallel.compile=true``), runs ``--warmup`` steps, profiles
``--steps`` more and prints the top ``--top`` operators by self CPU time. ``--by-caller`` profiles with Python
stacks and prints the top operators, then the top (caller, operator) pairs, the caller being the innermost frame or
backward node that ``CALLERS`` names (FSDP2, the chunked loss, the attention backend, the optimizer, ...).

``OMP_WAIT_POLICY`` defaults to ``passive`` here, as in ``peer_hf.py``: on an oversubscribed machine OpenMP's
spin-waiting inflates every small operator (copies, fills, cats), and the table then blames data movement for
time spent waiting on descheduled threads.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # read when torch loads OpenMP: before the import below
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from benchmarks.figures import captured, markdown_argument, publish  # noqa: E402

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


INDUCTOR_KERNEL = "<built-in function kernel>"
"""How a call into Inductor's generated C++ (the fused kernels of compiled blocks) shows up with Python stacks."""


def operator_of(event) -> str | None:
    """The operator an event stands for: an aten op, an Inductor kernel, or ``None`` (a Python frame)."""
    if event.name.startswith("aten::"):
        return event.name
    return "inductor kernel" if event.name == INDUCTOR_KERNEL else None


def by_caller(prof, steps: int, top: int) -> None:
    """With Python stacks: the top operators, then the top (caller, operator) pairs, by self CPU time per step
    (Python frames left out: an idle thread's ``wait`` would otherwise top the table)."""
    totals: dict[tuple[str, str], float] = {}
    for event in prof.events():
        if op := operator_of(event):
            key = (caller_of(event), op)
            totals[key] = totals.get(key, 0.0) + event.self_cpu_time_total
    grand = sum(totals.values())
    per_op: dict[str, float] = {}
    for (_, op), us in totals.items():
        per_op[op] = per_op.get(op, 0.0) + us
    print(f"operators: {grand / 1000 / steps:.0f} ms of self CPU time per step")
    for op, us in sorted(per_op.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{op[:50]:50s} {us / 1000 / steps:8.1f} {100 * us / grand:5.1f}%")
    print(f"\n{'caller':42s} {'operator':28s} {'ms/step':>8s} {'share':>6s}")
    for (caller, op), us in sorted(totals.items(), key=lambda kv: -kv[1])[: 3 * top]:
        print(f"{caller[:42]:42s} {op[:28]:28s} {us / 1000 / steps:8.1f} {100 * us / grand:5.1f}%")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2_4x256")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--by-caller", action="store_true", help="also break operators down by caller (slower)")
    markdown_argument(p)
    args, overrides = p.parse_known_args(argv)

    import torch
    from hydra import compose, initialize_config_dir
    from peer_hf import SIZES, model_shape
    from torch.profiler import ProfilerActivity, profile

    from trainer.compose import config_dir, register_configs, to_job_config
    from trainer.loop import Trainer

    if args.model not in SIZES:
        p.error(f"--model must be one of {', '.join(SIZES)}")
    torch.set_num_threads(args.threads)
    shape = [f"++model.config_overrides.{k}={v}" for k, v in model_shape(args.model).items()]
    register_configs()
    with initialize_config_dir(str(config_dir()), version_base=None):
        cfg = to_job_config(
            compose(
                "config",
                overrides=[
                    "recipe=cpu_dailydialog",
                    "grad_accum=1",
                    "parallel=fsdp_fp32",
                    "eval.holdout_fraction=0",
                    "logger.peak_tflops=1",
                    "logger.progress_bar=false",
                    "logger.log_every=1000",
                    f"max_steps={args.warmup + args.steps + 1}",
                    f"run_dir={tempfile.mkdtemp(prefix='profile-')}",
                    *shape,
                    *overrides,
                ],
            )
        )
    trainer = Trainer(cfg)
    trainer.model.train()
    for _ in range(args.warmup):
        trainer.train_step()
    with profile(activities=[ProfilerActivity.CPU], with_stack=args.by_caller) as prof:
        useful = sum(trainer.train_step().useful_tokens for _ in range(args.steps))
    total_ms = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1000 / args.steps
    with captured() as out:
        print(
            f"{args.model}, loss {trainer.loss_impl}, {' '.join(overrides) or 'defaults'}: "
            f"{total_ms:.0f} ms of CPU op time per step, {useful / args.steps:.0f} useful tokens per step"
        )
        if args.by_caller:
            by_caller(prof, args.steps, args.top)
        else:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    publish(args.markdown, "benchmarks/profile_step.py", out.block(), args.threads, argv)


if __name__ == "__main__":
    main()
