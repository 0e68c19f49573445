"""Distillation benchmark: packed vs padded (useful tokens/s) and the teacher's memory live vs precomputed, side by
side in one run.

    python benchmarks/distill.py [--student qwen2_2m] [--teacher qwen2_8m] [--steps 8] [--warmup 1] [--threads 2]
                                 [--budget 4096] [--records 1000] [--markdown FILE] [--json FILE]

Each arm is ``trainer.train`` on one rank in its own process (its own threads and memory), one after the other,
on cpu_distill's data (the generated chats, loss on the replies, the local BPE), the same student (random init,
seed 1234, fp32 master weights, bf16 compute under FSDP2), the same teacher and the same settings (forward KL,
temperature 1, alpha 0.5, chunked heads), ``--steps`` timed optimizer steps of one micro-batch of about
``--budget`` tokens (packed) or as many examples as a packed one holds on average (padded), after ``--warmup``:

- ``packed_live`` / ``padded_live``: the teacher live (FSDP2-sharded, frozen, bf16), run beside the student;
- ``packed_precompute`` / ``padded_precompute``: ``distill.teacher_logits=precompute``: the teacher's top-64 per
  label token, stored by one pass before the arms (its own process, ``pass``: its time and the store's size), so
  each arm reads the store and never holds the teacher (freed memory a process keeps would blur its figures).

The teacher (``--teacher``) is a random Qwen2 with the run's tokenizer, saved once as a model folder: throughput
and memory do not depend on what it learned. Useful tokens = the label tokens (replies) of the timed steps.
Memory: ``teacher_mib``, the teacher's parameters this rank holds while training (0 when precomputed);
``train_rss_gib``, the process's resident set sampled every 2 ms during the training steps (after setup);
``peak_rss_gib``, the whole process's peak; ``store_mib``, the top-k store on disk. On CPU these are the
figures; on a GPU the same arms' CUDA peak is ``peak_mem_gib`` of each run's summary. The data cache (and the
store) live in the benchmark's own folder under ``$PACKFSDP_CACHE/benchmarks``; the ``pass`` deletes the stores
there first, so it is timed every run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.dpo import SEED, VOCAB, compose_job, qwen2_shape, timed_job_overrides  # noqa: E402
from benchmarks.figures import load_average, markdown_argument, publish  # noqa: E402
from benchmarks.peer_hf import run_worker  # noqa: E402
from trainer.objectives.distill.topk import STORE_PREFIX  # noqa: E402

ARMS = {
    "packed_live": [],
    "padded_live": ["packing=none"],
    "packed_precompute": ["distill.teacher_logits=precompute"],
    "padded_precompute": ["distill.teacher_logits=precompute", "packing=none"],
}
SIZES = {
    "qwen2_smoke": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4),
    "qwen2_2m": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4),
    "qwen2_8m": dict(hidden_size=256, intermediate_size=896, num_hidden_layers=6, num_attention_heads=4),
    "qwen2_30m": dict(hidden_size=512, intermediate_size=1792, num_hidden_layers=8, num_attention_heads=8),
}
"""``--student`` / ``--teacher`` choices (Qwen2 shapes; KV heads a quarter of the query heads, tied head)."""


def shape(size: str) -> dict:
    return qwen2_shape(SIZES[size])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--student", default="qwen2_2m", choices=list(SIZES))
    p.add_argument("--teacher", default="qwen2_8m", choices=list(SIZES))
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per arm")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads for every arm")
    p.add_argument("--budget", type=int, default=4096, help="tokens per packed micro-batch")
    p.add_argument("--records", type=int, default=1000, help="generated chats (the precompute pass covers them all)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    markdown_argument(p)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--teacher-dir", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def job_overrides(args: argparse.Namespace) -> list[str]:
    """The job every arm shares."""
    return [
        "recipe=cpu_distill",
        f"data.num_records={args.records}",
        f"distill.teacher={args.teacher_dir}",
        f"data.cache_dir={args.teacher_dir.parent / 'distill_data'}",
        *timed_job_overrides(args.budget, args.warmup, args.steps, shape(args.student)),
    ]


def build_teacher(args: argparse.Namespace, folder: Path) -> Path:
    """A random Qwen2 of ``--teacher``'s shape with the run's tokenizer, saved as a model folder (once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.data import load_tokenizer

    if (folder / "config.json").is_file():
        return folder
    job = compose_job(
        ["recipe=cpu_chat_sft", f"data.num_records={args.records}", f"model.tokenizer_vocab_size={VOCAB}"]
    )
    tokenizer = load_tokenizer(job.model, job.data)
    torch.manual_seed(SEED)
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape(args.teacher),
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class RssSampler:
    """The process's resident set, sampled every ``every`` seconds in a thread, and its peak."""

    def __init__(self, every: float = 0.002) -> None:
        self.every, self.peak, self.stop = every, 0, threading.Event()
        self.page = os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> RssSampler:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def run(self) -> None:
        with open("/proc/self/statm") as f:
            while not self.stop.is_set():
                f.seek(0)
                self.peak = max(self.peak, int(f.read().split()[1]) * self.page)
                time.sleep(self.every)


def worker(arm: str, args: argparse.Namespace) -> dict:
    """One arm on one rank, in this process: setup timed apart, then the steps (``pass``: the precompute pass alone)."""
    import torch

    from trainer.loop import Trainer
    from trainer.objectives.distill.objective import local_bytes

    torch.set_num_threads(args.threads)
    overrides = ARMS.get(arm, ["distill.teacher_logits=precompute"])
    if arm == "pass":  # this benchmark's own stores: computed afresh, so the pass is timed
        for old in (args.teacher_dir.parent / "distill_data" / "datasets").glob(f"*/{STORE_PREFIX}*"):
            shutil.rmtree(old)
    cfg = compose_job([*job_overrides(args), f"run_dir={tempfile.mkdtemp(prefix=f'distill-{arm}-')}", *overrides])
    start = time.perf_counter()
    trainer = Trainer(cfg)
    setup_s = time.perf_counter() - start
    objective = trainer.objective
    if arm == "pass":
        return {
            "pass_s": setup_s,
            "store_mib": sum(f.stat().st_size for f in objective.store.folder.iterdir()) / 2**20,
            "store": str(objective.store.folder),
        }
    with RssSampler() as rss:
        summary = trainer.train()
    store = objective.store
    return {
        "useful_tokens_per_s": summary["useful_tokens_per_s"],
        "step_time_s": summary["mean_step_time_s"],
        "padding_fraction": summary["padding_fraction"],
        "final_loss": summary["final_loss"],
        "teacher_mib": 0.0
        if objective.teacher is None
        else sum(local_bytes(p) for p in objective.teacher.parameters()) / 2**20,
        "train_rss_gib": rss.peak / 2**30,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "store_mib": 0.0 if store is None else sum(f.stat().st_size for f in store.folder.iterdir()) / 2**20,
        "setup_s": setup_s,
    }


def table(results: dict[str, dict]) -> str:
    packed = {k.split("_", 1)[1]: r["useful_tokens_per_s"] for k, r in results.items() if k.startswith("packed_")}
    rows = [
        "| arm | useful tokens/s | packed / padded | padding | ms/step | teacher held (MiB) | RSS while training "
        "(GiB) | peak RSS (GiB) | top-k store (MiB) | setup (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, r in results.items():
        mode, teacher = arm.split("_", 1)
        ratio = f"{packed[teacher] / r['useful_tokens_per_s']:.2f}x" if mode == "padded" and teacher in packed else ""
        rows.append(
            f"| `{arm}` | {r['useful_tokens_per_s']:,.0f} | {ratio} | {100 * r['padding_fraction']:.0f}% | "
            f"{1000 * r['step_time_s']:,.0f} | {r['teacher_mib']:.1f} | {r['train_rss_gib']:.2f} | "
            f"{r['peak_rss_gib']:.2f} | {r['store_mib']:.1f} | {r['setup_s']:.1f} |"
        )
    return "\n".join(rows)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        args.result.write_text(json.dumps(worker(args.worker, args)))
        return {}
    import torch

    cache = Path(os.environ.get("PACKFSDP_CACHE", "~/.cache/packfsdp")).expanduser() / "benchmarks"
    args.teacher_dir = build_teacher(args, cache / f"distill_teacher_{args.teacher}_{args.records}")
    print(
        f"distill benchmark: student Qwen2 {args.student}, teacher Qwen2 {args.teacher}, {args.records} chats, "
        f"{args.steps} timed steps after {args.warmup}, {args.threads} thread(s), ~{args.budget} tokens per step, "
        f"torch {torch.__version__}, load average {load_average()}"
    )
    flags = [
        f"--student={args.student}",
        f"--teacher={args.teacher}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--threads={args.threads}",
        f"--budget={args.budget}",
        f"--records={args.records}",
        f"--teacher-dir={args.teacher_dir}",
    ]
    store = None
    if any("precompute" in arm for arm in args.arms):  # the store first, in a process of its own
        store = run_worker(Path(__file__), "pass", flags, args.threads, "passive")
        if store is not None:
            print(
                f"precompute pass: {store['pass_s']:.1f} s (setup included), store {store['store_mib']:.1f} MiB "
                f"({store['store']})",
                flush=True,
            )
    results = {}
    for arm in args.arms:
        r = run_worker(Path(__file__), arm, flags, args.threads, "passive")
        if r is None:
            continue
        results[arm] = r
        print(
            f"{arm:18s} {r['useful_tokens_per_s']:8,.0f} useful tok/s | {1000 * r['step_time_s']:7,.0f} ms/step | "
            f"padding {100 * r['padding_fraction']:.0f}% | teacher {r['teacher_mib']:.1f} MiB | RSS while training "
            f"{r['train_rss_gib']:.2f} GiB (peak {r['peak_rss_gib']:.2f}) | store {r['store_mib']:.1f} MiB | "
            f"setup {r['setup_s']:.1f} s",
            flush=True,
        )
    print(f"load average at the end: {load_average()}")
    md = table(results)
    print(md)
    shown = [f for f in flags if not f.startswith("--teacher-dir")]  # every setting, defaults included
    note = f"{args.threads} thread(s) per arm" + (f"; precompute pass {store['pass_s']:.1f} s" if store else "")
    publish(args.markdown, "benchmarks/distill.py", f"{note}\n\n{md}", argv=shown)
    if args.json:
        args.json.write_text(
            json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2)
        )
    return results


if __name__ == "__main__":
    main()
