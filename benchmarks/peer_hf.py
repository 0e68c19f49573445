"""Peer benchmark: packfsdp next to Hugging Face's ways of training on variable-length data.

    python benchmarks/peer_hf.py --model gpt2_4x256 [--steps 20] [--warmup 3] [--threads 2] [--rounds 3]
    python benchmarks/peer_hf.py --model gpt2_30m --steps 8

Each system in its own process, interleaved (round 1 runs every system once, then round 2, ...), on the same
GPT-2 (``--model``: random init, same seed), the same tokenized DailyDialog-like examples (the embedded default,
loss on all tokens, no held-out split), the same CPU threads, fp32 (``--dtype bf16`` for bf16 compute), AdamW,
one micro-batch of about ``--budget`` tokens per optimizer step. Sizes (vocabulary: the local tokenizer's 8,192):

- ``gpt2_2x128``: 2 layers, width 128 (the default recipe's model, ~1.2M parameters);
- ``gpt2_4x256``: 4 layers, width 256 (~5.5M);
- ``gpt2_30m``: 8 layers, width 512 (~29M).

Systems:

- ``hf_padded``: transformers ``Trainer``, random batches padded to the longest (``DataCollatorForSeq2Seq``),
  as many examples per batch as a packed micro-batch holds on average;
- ``hf_flattening``: ``Trainer`` with ``DataCollatorWithFlattening`` (same batches, concatenated, position
  ids restart per example; transformers' SDPA path turns them into a block-diagonal mask);
- ``trl_sft_bfd``: TRL ``SFTTrainer`` with ``packing=True, packing_strategy="bfd"`` into ``--budget``-token
  rows (only when ``trl`` is installed: ``pip install trl``). TRL >= 1.x always computes the loss through its
  own fused, chunked LM head (no full logits), so this is TRL's fused loss; its plain-loss path no longer
  exists, and its Liger option needs CUDA;
- ``packfsdp_padded`` and ``packfsdp_packed``: ``trainer.train`` on one rank (in the worker process), with the
  default chunked loss (``loss.impl=chunked``); ``packfsdp_contiguous``: the same bins, each turned into one
  boundary-free row (positions 0..T-1, plain causal attention over the whole row: the layout of pretraining on
  concatenated text, the "padding-free limit" packed is held to). Opt-in: ``packfsdp_packed_compiled`` and
  ``packfsdp_padded_compiled`` (``parallel.compile=true``, Inductor; compile time lands in the warm-up, which
  the rate excludes; the arm prints setup + warm-up seconds), ``packfsdp_packed_naive`` (``loss.impl=naive``).

Every system runs under ``OMP_WAIT_POLICY=passive`` (``--omp-wait-policy``): on a machine with more runnable
threads than cores, OpenMP's default spin-waiting makes every parallel region wait for a descheduled thread
while its partner burns the core, and a step took 5-10x longer with a swing that buried every difference
between the systems. On a quiet machine ``active`` is a little faster; it applies to every system alike.

Useful tokens = tokens with a label (the first token of each example never has one), counted from the
batches each system actually trained on. Throughput = useful tokens of the timed steps / their wall time
(data loading, forward, backward and optimizer step included), after ``--warmup`` steps.
Prints one line per system and run, then each system's median over the rounds and packfsdp packed's ratio of
medians to each; the target is >= 1.3x the fastest peer. The machine's load comes and goes: interleaving
exposes every system to it alike, and the median ignores a disturbed run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.figures import captured, load_average, markdown_argument, publish  # noqa: E402

PEERS = ("hf_padded", "hf_flattening", "trl_sft_bfd")
PACKFSDP_ARMS = {
    "packfsdp_padded": ["packing=none"],
    "packfsdp_padded_compiled": ["packing=none", "parallel.compile=true"],
    "packfsdp_packed": [],
    "packfsdp_packed_compiled": ["parallel.compile=true"],
    "packfsdp_packed_naive": ["loss=naive"],
    "packfsdp_contiguous": [],
}
"""Each packfsdp system's Hydra overrides on top of the shared ones (``packfsdp_contiguous`` also rewrites
its batches: ``contiguous_rows``)."""


OURS = tuple(PACKFSDP_ARMS)
DEFAULT_SYSTEMS = (*PEERS, "packfsdp_padded", "packfsdp_contiguous", "packfsdp_packed")
SEED, LR = 1234, 1e-3
SIZES = {
    "gpt2_2x128": dict(n_layer=2, n_embd=128, n_head=4),
    "gpt2_4x256": dict(n_layer=4, n_embd=256, n_head=4),
    "gpt2_30m": dict(n_layer=8, n_embd=512, n_head=8),
}
"""``--model`` choices: GPT-2 shapes (every size: 1024 positions, no dropout, the local 8,192-token vocabulary)."""
COMMON = dict(n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def model_shape(size: str) -> dict:
    return SIZES[size] | COMMON


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2_4x256", choices=list(SIZES), help="model size (see the docstring)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype of every system")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per system")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads for every system")
    p.add_argument(
        "--omp-wait-policy",
        default="passive",
        choices=["passive", "active"],
        help="OMP_WAIT_POLICY of every system (see the docstring)",
    )
    p.add_argument("--budget", type=int, default=1024, help="tokens per packed micro-batch / packed row")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="run every system this many times, interleaved; each system's median is compared",
    )
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=[*PEERS, *OURS])
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    markdown_argument(p)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------- shared data
def load_examples(budget: int):
    """The embedded default's tokenizer and tokenized examples (cached by trainer.data)."""
    from trainer.config import DataConfig, ModelConfig
    from trainer.data import load_dataset, load_tokenizer

    data_cfg = DataConfig()
    data_cfg.cache_dir = os.path.expanduser(os.environ.get("PACKFSDP_CACHE", "~/.cache/packfsdp"))
    tokenizer = load_tokenizer(ModelConfig(), data_cfg)
    return tokenizer, load_dataset(data_cfg, tokenizer, min(data_cfg.max_length, budget))


def matched_batch_size(dataset, budget: int) -> int:
    from trainer.config import PackingConfig
    from trainer.packing import matched_padded_batch_size

    return matched_padded_batch_size(dataset.lengths, PackingConfig(token_budget=budget), SEED)


# --------------------------------------------------------------------------------------------- HF systems
def hf_worker(system: str, args: argparse.Namespace) -> dict:
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        DataCollatorForSeq2Seq,
        DataCollatorWithFlattening,
        Trainer,
        TrainingArguments,
    )

    from trainer.collate import _labels_for

    torch.set_num_threads(args.threads)
    tokenizer, dataset = load_examples(args.budget)
    ids, labels = [], []
    for i in range(len(dataset)):
        tok, mask = dataset.example(i)
        ids.append(tok.astype(np.int64).tolist())
        labels.append(_labels_for(tok, mask).tolist())
    torch.manual_seed(SEED)
    config = AutoConfig.for_model(
        "gpt2",
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **model_shape(args.model),
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    bf16 = args.dtype == "bf16"
    steps = args.warmup + args.steps
    out_dir = tempfile.mkdtemp(prefix=f"peer-{system}-")
    common = dict(
        output_dir=out_dir,
        max_steps=steps,
        gradient_accumulation_steps=1,
        learning_rate=LR,
        weight_decay=0.1,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        bf16=bf16,
        use_cpu=True,
        report_to=[],
        logging_steps=10**6,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=SEED,
        disable_tqdm=True,
        remove_unused_columns=False,
    )

    if system == "trl_sft_bfd":
        from trl import SFTConfig, SFTTrainer

        sft_args = SFTConfig(
            **common, per_device_train_batch_size=1, max_length=args.budget, packing=True, packing_strategy="bfd"
        )
        trainer = SFTTrainer(
            model=model, args=sft_args, train_dataset=Dataset.from_dict({"input_ids": ids}), processing_class=tokenizer
        )
        batch_note = f"bfd rows of {args.budget} tokens"
    else:
        bs = matched_batch_size(dataset, args.budget)
        collator = (
            DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
            if system == "hf_flattening"
            else DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
        )
        trainer = Trainer(
            model=model,
            args=TrainingArguments(**common, per_device_train_batch_size=bs),
            train_dataset=Dataset.from_dict({"input_ids": ids, "labels": labels}),
            data_collator=collator,
        )
        batch_note = f"{bs} examples per batch"

    # the model shifts: labels[0] is never predicted
    counts, ends = timed_train(trainer, lambda batch: int((batch["labels"][..., 1:] != -100).sum()))
    w = args.warmup
    seconds = ends[steps - 1] - ends[w - 1] if w > 0 else ends[steps - 1] - ends[0]
    useful = sum(counts[w:steps]) if w > 0 else sum(counts[1:steps])
    return {
        "useful_tokens_per_s": useful / seconds,
        "useful_tokens_per_step": useful / args.steps,
        "step_time_s": seconds / args.steps,
        "batches": batch_note,
    }


def timed_train(trainer, count) -> tuple[list, list[float]]:
    """``trainer.train()`` with ``count(batch)`` of every batch its collator made and each step's end time
    (``time.perf_counter``): what a peer's throughput is computed from."""
    from transformers import TrainerCallback

    counts: list = []
    ends: list[float] = []
    inner = trainer.data_collator

    def counting_collator(features):
        batch = inner(features)
        counts.append(count(batch))
        return batch

    class StepClock(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    trainer.data_collator = counting_collator
    trainer.add_callback(StepClock())
    trainer.train()
    return counts, ends


# --------------------------------------------------------------------------------------------- packfsdp
def contiguous_rows(collate):
    """``collate`` with every packed row turned into one boundary-free sequence: the same tokens and labels,
    positions 0..T-1 and plain causal attention over the whole row (the layout of pretraining on
    concatenated text; what packing's per-example attention is compared with)."""
    import torch

    def collate_contiguous(dataset, indices, pad_id=0):
        batch = collate(dataset, indices, pad_id)
        n = batch.num_tokens
        batch.cu_seqlens = torch.tensor([0, n], dtype=torch.int32)
        batch.position_ids = torch.arange(n)[None]
        batch.max_seqlen = n
        return batch

    return collate_contiguous


def packfsdp_worker(system: str, args: argparse.Namespace) -> dict:
    """trainer.train on one rank, in this process, timed by its own summary (same definition: labels / step
    wall time, after the warm-up steps, so a compiled arm's compile time is not in its rate)."""
    import torch
    from hydra import compose, initialize_config_dir

    import trainer.collate
    from trainer.compose import config_dir, register_configs, to_job_config
    from trainer.train import run

    torch.set_num_threads(args.threads)
    shape = [f"++model.config_overrides.{k}={v}" for k, v in model_shape(args.model).items()]
    overrides = [
        "recipe=cpu_dailydialog",
        "grad_accum=1",
        *shape,
        f"parallel={'fsdp_fp32' if args.dtype == 'fp32' else 'fsdp'}",
        "logger.peak_tflops=1",
        "packing=bfd",
        f"packing.token_budget={args.budget}",
        f"max_steps={args.warmup + args.steps}",
        f"summary_skip_steps={args.warmup}",
        "eval.holdout_fraction=0",
        f"optim.lr={LR}",
        "optim.warmup_steps=0",
        "optim.min_lr_ratio=1.0",
        f"seed={SEED}",
        "logger.progress_bar=false",
        "logger.log_every=1000",
        f"run_dir={tempfile.mkdtemp(prefix=f'peer-{system}-')}",
        *PACKFSDP_ARMS[system],
    ]
    if system == "packfsdp_contiguous":
        trainer.collate.collate_packed = contiguous_rows(trainer.collate.collate_packed)
    register_configs()
    with initialize_config_dir(str(config_dir()), version_base=None):
        cfg = to_job_config(compose("config", overrides=overrides))
    start = time.perf_counter()
    summary = run(cfg)
    per_step = summary["useful_tokens_per_s"] * summary["mean_step_time_s"]
    untimed = time.perf_counter() - start - args.steps * summary["mean_step_time_s"]
    layout = (
        "matched padded batches"
        if "padded" in system
        else "bfd bins as contiguous rows"
        if system == "packfsdp_contiguous"
        else "bfd bins"
    )
    return {
        "useful_tokens_per_s": summary["useful_tokens_per_s"],
        "useful_tokens_per_step": per_step,
        "step_time_s": summary["mean_step_time_s"],
        "batches": f"{layout}, loss {summary.get('loss_impl')}, "
        f"compile {summary.get('compile', 'off')}, setup + warm-up {untimed:.0f} s",
    }


# ------------------------------------------------------------------------------------------------ driver
def run_system(system: str, args: argparse.Namespace) -> dict | None:
    flags = [
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--budget",
        str(args.budget),
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--omp-wait-policy",
        args.omp_wait_policy,
    ]
    return run_worker(Path(__file__), system, flags, args.threads, args.omp_wait_policy)


def run_worker(script: Path, system: str, flags: list[str], threads: int, omp_wait_policy: str) -> dict | None:
    """``python SCRIPT --worker SYSTEM --result FILE FLAGS`` in its own process (its own threads and peak
    memory); the JSON it writes, or None (printed) when it failed or, for a TRL system (``trl_*``), when trl
    is not installed. Shared by the benchmarks that compare systems."""
    if system.startswith("trl_") and importlib.util.find_spec("trl") is None:
        print(f"{system:16s} skipped: trl is not installed (pip install -e .[peer])")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(script.resolve()), "--worker", system, "--result", str(result), *flags]
        env = os.environ | {
            "OMP_NUM_THREADS": str(threads),
            "OMP_WAIT_POLICY": omp_wait_policy,
            "TOKENIZERS_PARALLELISM": "false",
            "WANDB_MODE": "disabled",
            "PYTHONPATH": str(REPO),
        }
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not result.is_file():
            print(f"{system:16s} FAILED (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            return None
        return json.loads(result.read_text())


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        fn = packfsdp_worker if args.worker in OURS else hf_worker
        args.result.write_text(json.dumps(fn(args.worker, args)))
        return {}
    import torch

    print(
        f"peer benchmark: GPT-2 {args.model} ({args.dtype}), {args.steps} timed steps after {args.warmup}, "
        f"{args.threads} thread(s), ~{args.budget} tokens per step, {args.rounds} interleaved rounds, "
        f"OMP_WAIT_POLICY={args.omp_wait_policy}, torch {torch.__version__}, load average {load_average()}"
    )
    runs: dict[str, list[dict]] = {}
    for round_ in range(1, args.rounds + 1):
        for system in args.systems:
            r = run_system(system, args)
            if r is None:
                continue
            runs.setdefault(system, []).append(r)
            print(
                f"round {round_} {system:22s} {r['useful_tokens_per_s']:10,.0f} useful tok/s | "
                f"{r['useful_tokens_per_step']:6.0f} useful tok/step | {1000 * r['step_time_s']:6.0f} ms/step | "
                f"{r['batches']}",
                flush=True,
            )
    print(f"load average at the end: {load_average()}")
    with captured() as summary:
        results = summarize(runs)
        report_ratios(results)
    publish(args.markdown, f"benchmarks/peer_hf.py --model {args.model}", summary.block(), args.threads, argv)
    if args.json:
        skip = ("json", "result", "markdown")
        args.json.write_text(
            json.dumps(
                {"settings": {k: v for k, v in vars(args).items() if k not in skip}, "results": results},
                indent=2,
                default=str,
            )
        )
    return results


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Each system's median useful tokens/s over its runs (and the runs themselves)."""
    print("median over the rounds:")
    results = {}
    for system, rs in runs.items():
        rates = [r["useful_tokens_per_s"] for r in rs]
        results[system] = rs[-1] | {"median_useful_tokens_per_s": statistics.median(rates), "runs": rates}
        print(
            f"{system:22s} {results[system]['median_useful_tokens_per_s']:10,.0f} useful tok/s  "
            f"(runs: {', '.join(f'{x:,.0f}' for x in rates)})"
        )
    return results


def report_ratios(results: dict[str, dict]) -> None:
    """packfsdp packed's ratio of medians to every other system, and the verdict against the fastest peer."""
    key = "median_useful_tokens_per_s"
    ours = results.get("packfsdp_packed")
    if not ours:
        return
    for name, r in results.items():
        if name != "packfsdp_packed":
            print(f"packfsdp_packed / {name}: {ours[key] / r[key]:.2f}x")
    if rows := results.get("packfsdp_contiguous"):
        ratio = ours[key] / rows[key]
        print(
            f"vs the same model on boundary-free contiguous rows: {ratio:.2f}x -> target 1.0x "
            f"{'met' if ratio >= 1.0 else 'NOT met'}"
        )
    peers = {k: v for k, v in results.items() if k in PEERS}
    if peers:
        best = max(peers, key=lambda k: peers[k][key])
        ratio = ours[key] / peers[best][key]
        verdict = "met" if ratio >= 1.3 else "NOT met"
        print(f"vs the fastest peer ({best}), on medians: {ratio:.2f}x -> target 1.3x {verdict}")
        # Within a round every system met about the same load: the ratio to that round's fastest peer.
        rounds = min(len(r["runs"]) for r in (ours, *peers.values()))
        per_round = [ours["runs"][i] / max(p["runs"][i] for p in peers.values()) for i in range(rounds)]
        print(
            f"per round, vs that round's fastest peer: {', '.join(f'{x:.2f}x' for x in per_round)} "
            f"(median {statistics.median(per_round):.2f}x)"
        )


if __name__ == "__main__":
    main()
