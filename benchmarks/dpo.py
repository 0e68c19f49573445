"""DPO benchmark: packed DPO vs padded DPO vs TRL's ``DPOTrainer``, and the reference's memory, side by side.

    python benchmarks/dpo.py [--model qwen2_30m] [--steps 2] [--warmup 1] [--threads 2] [--budget 4096]
                             [--activation-checkpointing on|off]
    python benchmarks/dpo.py --model qwen2_8m --steps 4 --markdown docs/figures/dpo.md

Each system in its own process (so each one's peak memory is its own), one after the other, on the same
Qwen2-shaped model (``--model``: random init, same seed, fp32, GQA 4:1, tied embeddings), the same generated
pairs, the same CPU threads (``torch.set_num_threads`` and ``OMP_NUM_THREADS``), AdamW, one micro-batch of
about ``--budget`` tokens per optimizer step, the sigmoid DPO loss at beta 0.1, a live reference unless said,
and the same activation checkpointing (``--activation-checkpointing``: ``on``, TRL ``DPOConfig``'s default
``gradient_checkpointing=True``, is packfsdp's ``parallel.activation_checkpointing=full``; ``off`` for both):

- ``packfsdp_packed``: ``trainer.train`` on one rank, ``objective=dpo``, pairs packed whole (bfd);
- ``packfsdp_padded``: the same with ``packing=none`` (one row per sequence, padded to the longest of the
  micro-batch; as many pairs per micro-batch as a packed one holds on average);
- ``trl_dpo``: TRL's ``DPOTrainer`` (its default: padded, ``padding_free`` is off for DPO), the same pairs
  per batch as ``packfsdp_padded``, ``ref_model`` a frozen copy of the model (TRL's live reference);
- ``packfsdp_precompute``: ``packfsdp_packed`` with ``dpo.reference=precompute`` (the reference's log-probs
  from one pass before training, stored with the data cache: one model in memory).

The pairs (``make_pairs``; the length model is an assumption, not a measurement: no hub here): UltraFeedback-
like token lengths, the prompt log-normal with median 150 tokens (sigma 0.6, clipped to 8..512), each reply
log-normal with median 250 (sigma 0.7, clipped to 4..1536: a long tail to ~1.5k), chosen and rejected drawn
independently; words from a 400-word vocabulary on which the local BPE learns one token per word, so a
length in words is a length in tokens (plus the EOS and, for packfsdp, a BOS: TRL's tokenization has no BOS).

Useful tokens = the label tokens of both replies (prompts never count), from the batches each system trained
on. Throughput = useful tokens of the timed steps / their wall time (forward of policy and reference,
backward, optimizer step), after ``--warmup`` steps. Peak memory: the process's peak resident set (CPU),
setup included. Saved for backward: the peak over the run of the tensors autograd holds for the backward
(distinct storages, weights left out; ``SavedForBackward``), what activation checkpointing trades for
recompute. Prints one line per system, the ratios, and (``--markdown FILE``) writes the table as its section of
FILE (``benchmarks/figures.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import weakref
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.figures import load_average, markdown_argument, publish  # noqa: E402
from benchmarks.peer_hf import run_worker, timed_train  # noqa: E402
from trainer.data.synthetic import ultrafeedback_like_pairs  # noqa: E402

SYSTEMS = ("packfsdp_packed", "packfsdp_padded", "trl_dpo", "packfsdp_precompute")
ARMS = {"packfsdp_packed": [], "packfsdp_padded": ["packing=none"], "packfsdp_precompute": ["dpo.reference=precompute"]}
SEED, LR, BETA = 1234, 1e-5, 0.1
SIZES = {
    "qwen2_smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "qwen2_8m": dict(hidden_size=256, intermediate_size=896, num_hidden_layers=6, num_attention_heads=4),
    "qwen2_30m": dict(hidden_size=512, intermediate_size=1792, num_hidden_layers=8, num_attention_heads=8),
}
"""``--model`` choices (Qwen2 shapes; KV heads a quarter of the query heads, 4,096 positions, tied head)."""
VOCAB = 4096
PAIRS = 64
WORDS = 400


def qwen2_shape(dims: dict) -> dict:
    """A Qwen2 config's overrides from its sizes: KV heads a quarter of the query heads, 4,096 positions, tied head."""
    return dims | dict(
        num_key_value_heads=max(1, dims["num_attention_heads"] // 4),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )


def model_shape(size: str) -> dict:
    return qwen2_shape(SIZES[size])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2_30m", choices=list(SIZES))
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per system")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads for every system")
    p.add_argument("--budget", type=int, default=4096, help="tokens per packed micro-batch (a pair is at most this)")
    p.add_argument("--pairs", type=int, default=PAIRS, help="pairs generated (precompute's pass covers them all)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument(
        "--activation-checkpointing",
        default="on",
        choices=("on", "off"),
        help="recompute each block's activations in backward, in every system (on: TRL's default)",
    )
    markdown_argument(p)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------- data
def make_pairs(path: Path, n: int = PAIRS, seed: int = SEED) -> dict:
    """Write ``n`` plain-string pairs (TRL's format) with UltraFeedback-like lengths; return length stats."""
    g = np.random.default_rng(seed)
    vocab = [f"w{chr(97 + k // 26 % 26)}{chr(97 + k % 26)}" for k in range(WORDS)]

    def words(k: int) -> str:
        return " " + " ".join(vocab[w] for w in g.integers(0, WORDS, k))

    lengths = ultrafeedback_like_pairs(n, g)
    with path.open("w") as f:
        for i in range(n):
            f.write(
                json.dumps(
                    {
                        "prompt": "Q:" + words(lengths["prompt"][i]),
                        "chosen": words(lengths["chosen"][i]),
                        "rejected": words(lengths["rejected"][i]),
                    }
                )
                + "\n"
            )
    pair = 2 * lengths["prompt"] + lengths["chosen"] + lengths["rejected"]
    return {k: int(np.median(v)) for k, v in lengths.items()} | {
        "pair_median": int(np.median(pair)),
        "pair_p95": int(np.percentile(pair, 95)),
        "pair_max": int(pair.max()),
    }


def timed_job_overrides(budget: int, warmup: int, steps: int, shape: dict) -> list[str]:
    """What every timed packfsdp job of these benchmarks sets: a random-init model of ``shape`` on the CPU, one
    micro-batch of ``budget`` tokens a step, ``warmup`` untimed steps then ``steps``, no holdout, and no logging,
    checkpoint or self-check in the timed steps."""
    return [
        f"data.max_length={budget}",
        f"model.tokenizer_vocab_size={VOCAB}",
        *[f"++model.random_init.{k}={v}" for k, v in shape.items()],
        "parallel.device=cpu",
        "grad_accum=1",
        f"packing.token_budget={budget}",
        f"max_steps={warmup + steps}",
        f"summary_skip_steps={warmup}",
        "eval.holdout_fraction=0",
        "optim.warmup_steps=0",
        f"seed={SEED}",
        "logger.peak_tflops=1",
        "logger.progress_bar=false",
        "logger.log_every=1000",
        "checkpoint.every_steps=0",
        "model.self_check=false",
    ]


def job_overrides(args: argparse.Namespace) -> list[str]:
    """The packfsdp job every system shares (TRL reads its tokenizer and batch size from it)."""
    return [
        "recipe=cpu_dpo",
        "data.source=jsonl",
        f"data.path={args.data}",
        *timed_job_overrides(args.budget, args.warmup, args.steps, model_shape(args.model)),
        "parallel=fsdp_fp32",
        f"dpo.beta={BETA}",
        f"optim.lr={LR}",
        "optim.min_lr_ratio=1.0",
        f"parallel.activation_checkpointing={'full' if args.activation_checkpointing == 'on' else 'none'}",
    ]


def compose_job(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from trainer.compose import config_dir, register_configs, to_job_config

    register_configs()
    with initialize_config_dir(str(config_dir()), version_base=None):
        return to_job_config(compose("config", overrides=overrides))


# ---------------------------------------------------------------------------------------------- workers
class SavedForBackward:
    """Installed around training (``torch.autograd.graph.saved_tensors_hooks``): the bytes of the tensors
    autograd holds for the backward, each storage once, and their peak. Weights (leaves that require grad)
    are left out: they are counted as parameters. Under activation checkpointing only what is saved outside
    the recomputed blocks is seen (the checkpoint keeps each block's input itself)."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}
        self.bytes = self.peak = 0

    def __enter__(self) -> SavedForBackward:
        import torch

        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    def pack(self, t):
        if t.is_leaf and t.requires_grad:
            return t
        storage = t.untyped_storage()
        ptr, entry = storage.data_ptr(), self.live.get(storage.data_ptr())
        if entry is None:
            self.live[ptr] = [storage.nbytes(), 1]
            self.bytes += storage.nbytes()
            self.peak = max(self.peak, self.bytes)
        else:
            entry[1] += 1
        weakref.finalize(t, self.release, ptr)  # autograd drops it after the backward that used it
        return t

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.live[ptr]


def packfsdp_worker(system: str, args: argparse.Namespace) -> dict:
    """trainer.train on one rank, in this process, timed by its own summary."""
    import torch

    from trainer.train import run

    torch.set_num_threads(args.threads)
    cfg = compose_job([*job_overrides(args), f"run_dir={tempfile.mkdtemp(prefix=f'dpo-{system}-')}", *ARMS[system]])
    with SavedForBackward() as saved:
        summary = run(cfg)
    return {
        "useful_tokens_per_s": summary["useful_tokens_per_s"],
        "step_time_s": summary["mean_step_time_s"],
        "useful_tokens_per_step": summary["useful_tokens_per_s"] * summary["mean_step_time_s"],
        "peak_mem_gib": summary["peak_mem_gib"],
        "padding_fraction": summary["padding_fraction"],
        "params": summary.get("model", {}).get("parameters") if isinstance(summary.get("model"), dict) else None,
        "saved_peak_gib": saved.peak / 2**30,
    }


def trl_worker(system: str, args: argparse.Namespace) -> dict:
    """TRL's DPOTrainer with its defaults (padded), the same tokenizer, model shape, seed and pairs per batch."""
    import resource

    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from trainer.config import PackingConfig
    from trainer.data import load_dataset, load_tokenizer
    from trainer.packing import matched_padded_batch_size

    torch.set_num_threads(args.threads)
    cfg = compose_job(job_overrides(args))
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    ours = load_dataset(cfg.data, tokenizer, args.budget)  # the pairs packfsdp_padded batches, for the same size
    batch_size = matched_padded_batch_size(ours.lengths, PackingConfig(token_budget=args.budget), SEED)
    torch.manual_seed(SEED)
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **model_shape(args.model),
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ref.load_state_dict(model.state_dict())
    rows = [json.loads(line) for line in args.data.read_text().splitlines()]
    steps = args.warmup + args.steps
    dpo_args = DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="dpo-trl-"),
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=batch_size,
        max_length=None,
        beta=BETA,
        loss_type=["sigmoid"],
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=SEED,
        gradient_checkpointing=args.activation_checkpointing == "on",
    )
    trainer = DPOTrainer(
        model=model, ref_model=ref, args=dpo_args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    # every completion token is predicted; positions: what the padded batch computes
    with SavedForBackward() as saved:
        sizes, ends = timed_train(trainer, lambda b: (int(b["completion_mask"].sum()), b["input_ids"].numel()))
    counts, positions = [c for c, _ in sizes], [n for _, n in sizes]
    w = args.warmup
    seconds = ends[steps - 1] - ends[w - 1]
    useful = sum(counts[w:steps])
    return {
        "useful_tokens_per_s": useful / seconds,
        "step_time_s": seconds / args.steps,
        "useful_tokens_per_step": useful / args.steps,
        "peak_mem_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "padding_fraction": 1 - sum(counts[w:steps]) / max(1, sum(positions[w:steps])),
        "pairs_per_batch": batch_size,
        "params": sum(p.numel() for p in model.parameters()),
        "saved_peak_gib": saved.peak / 2**30,
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
        "--data",
        str(args.data),
        "--activation-checkpointing",
        args.activation_checkpointing,
    ]
    start = time.perf_counter()
    result = run_worker(Path(__file__), system, flags, args.threads, "passive")
    return None if result is None else result | {"process_s": time.perf_counter() - start}


NOTES = {
    "packfsdp_packed": "pairs packed whole (bfd), live frozen reference",
    "packfsdp_padded": "packing=none: one padded row per sequence, live reference",
    "trl_dpo": "TRL DPOTrainer (padded: its default), ref_model a frozen copy",
    "packfsdp_precompute": "packed, dpo.reference=precompute (one model in memory)",
}


def table(results: dict[str, dict]) -> str:
    packed = results.get("packfsdp_packed", {}).get("useful_tokens_per_s")
    lines = [
        "| system | useful tokens/s | packed / this | padding | ms/step | peak memory (GiB) "
        "| saved for backward (GiB) | what |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        ratio = f"{packed / r['useful_tokens_per_s']:.2f}x" if packed else "-"
        lines.append(
            f"| `{name}` | {r['useful_tokens_per_s']:,.0f} | {ratio} | {100 * r['padding_fraction']:.0f}% | "
            f"{1000 * r['step_time_s']:,.0f} | {r['peak_mem_gib']:.2f} | {r['saved_peak_gib']:.2f} | {NOTES[name]} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        fn = trl_worker if args.worker == "trl_dpo" else packfsdp_worker
        args.result.write_text(json.dumps(fn(args.worker, args)))
        return {}
    import torch

    data_dir = Path(os.environ.get("PACKFSDP_CACHE", "~/.cache/packfsdp")).expanduser() / "benchmarks"
    data_dir.mkdir(parents=True, exist_ok=True)
    args.data = data_dir / f"dpo_pairs_{SEED}_{args.pairs}.jsonl"
    stats = make_pairs(args.data, args.pairs)
    print(
        f"dpo benchmark: Qwen2 {args.model} (fp32), {args.steps} timed steps after {args.warmup}, {args.threads} "
        f"thread(s), ~{args.budget} tokens per step, activation checkpointing {args.activation_checkpointing}, "
        f"torch {torch.__version__}, load average {load_average()}"
    )
    print(
        f"pairs: {args.pairs}, median tokens prompt {stats['prompt']} / chosen {stats['chosen']} / rejected "
        f"{stats['rejected']}; pair (prompt twice) median {stats['pair_median']}, p95 {stats['pair_p95']}, "
        f"max {stats['pair_max']}"
    )
    results = {}
    for system in args.systems:
        r = run_system(system, args)
        if r is None:
            continue
        results[system] = r
        print(
            f"{system:20s} {r['useful_tokens_per_s']:8,.0f} useful tok/s | {r['useful_tokens_per_step']:6.0f} "
            f"useful tok/step | {1000 * r['step_time_s']:7,.0f} ms/step | peak {r['peak_mem_gib']:.2f} GiB | "
            f"saved for backward {r['saved_peak_gib']:.2f} GiB | "
            f"padding {100 * r['padding_fraction']:.0f}% | process {r['process_s']:.0f} s",
            flush=True,
        )
    print(f"load average at the end: {load_average()}")
    for name, r in results.items():
        if name != "packfsdp_packed" and "packfsdp_packed" in results:
            ratio = results["packfsdp_packed"]["useful_tokens_per_s"] / r["useful_tokens_per_s"]
            print(f"packfsdp_packed / {name}: {ratio:.2f}x")
    if "packfsdp_precompute" in results and "packfsdp_packed" in results:
        live, pre = results["packfsdp_packed"]["peak_mem_gib"], results["packfsdp_precompute"]["peak_mem_gib"]
        print(f"peak memory, reference=live / precompute: {live:.2f} / {pre:.2f} GiB ({live / pre:.2f}x)")
    md = table(results)
    print(md)
    title = f"benchmarks/dpo.py --model {args.model} --activation-checkpointing {args.activation_checkpointing}"
    publish(args.markdown, title, md, args.threads, argv)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"settings": {k: str(v) for k, v in vars(args).items()}, "pairs": stats, "results": results}, indent=2
            )
        )
    return results


if __name__ == "__main__":
    main()
