"""Data preparation at the scale users fine-tune on (a script, not a test).

    python benchmarks/data_scale.py [--records 200000] [--workdir /tmp/packfsdp_data_scale] [--skip-reference]
    python benchmarks/data_scale.py --records 1000000 --skip-reference   # 1M chats (1.6 GB of JSONL)

Generates N ChatML-style multi-turn chats (an optional system prompt, then user/assistant turns; ~1.3 kB of
JSON each, like UltraChat) into a JSONL file, trains a byte-level BPE tokenizer with the ChatML markers once
on a sample (timed apart: the figures below exclude it), then runs, each in a fresh subprocess:

- ``packfsdp cold``: ``trainer.pipeline.build_training_data`` for ``recipe=cpu_chat_sft data=jsonl`` on that
  file (tokenize into an empty cache, held-out split, sampler), as the trainer and ``trainer.analyze`` do;
- ``packfsdp warm``: the same again, the tokenized cache now present;
  it also times the epoch plan (packing every example) and the first micro-batch from the process start;
- ``datasets``: the reference, ``datasets.load_dataset("json")`` + a batched ``map`` (``num_proc=2``) that
  renders each chat with the same template and tokenizes it, into Arrow.

For each: wall time, peak RSS of the child's main process (its VmHWM, sampled every 0.2 s) and the peak
summed over the child's process tree (map workers included), and tokens/s.
Then two ranks open the warm cache at once and read every token: their RSS, PSS (shared pages split between
the processes that map them) and private memory show that N ranks hold one copy.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks.figures import captured, load_average, markdown_argument, publish  # noqa: E402


def write_chats(path: Path, n: int, seed: int = 0) -> None:
    """``n`` chats as JSONL, generated vectorised (a few seconds for 1M)."""
    from trainer.data.synthetic import _WORDS, SYSTEM_PROMPTS

    rng = np.random.default_rng(seed)
    pairs = np.clip(1 + rng.negative_binomial(2, 0.45, size=n), 1, 12)  # user/assistant pairs, mean ~3.4
    messages_per_chat = 2 * pairs
    words_per_message = np.clip(np.rint(rng.lognormal(np.log(24), 0.8, size=int(messages_per_chat.sum()))), 2, 600)
    vocab = np.array(_WORDS)
    words = vocab[rng.integers(0, len(vocab), size=int(words_per_message.sum()))]
    system = rng.random(n) < 0.5
    ends = np.cumsum(words_per_message)
    starts = ends - words_per_message
    m = 0
    with open(path, "w") as f:
        for i in range(n):
            chat = [{"role": "system", "content": SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)]}] if system[i] else []
            for k in range(int(messages_per_chat[i])):
                text = " ".join(words[int(starts[m]) : int(ends[m])])
                chat.append({"role": "user" if k % 2 == 0 else "assistant", "content": text.capitalize() + "."})
                m += 1
            f.write(json.dumps({"messages": chat}) + "\n")


def train_tokenizer(data: Path, out: Path, sample: int = 20000) -> float:
    """Train the ChatML BPE (vocab 2048, as ``model=qwen2_tiny``) on the first ``sample`` chats; seconds."""
    from trainer.data.chat import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE
    from trainer.data.tokenizer import train_bpe_tokenizer

    start = time.perf_counter()
    texts = []
    with open(data) as f:
        for line in itertools.islice(f, sample):
            texts += [m["content"] for m in json.loads(line)["messages"]]
    tokenizer = train_bpe_tokenizer(texts, 2048, CHATML_SPECIAL_TOKENS)
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out)
    return time.perf_counter() - start


PACKFSDP_CHILD = """
import json, sys, time
import trainer.collate, trainer.data, trainer.packing  # what build_training_data imports (not the modelling code)
imports_done_at = time.time()
from trainer.compose import compose_job_config, register_configs
from trainer.pipeline import build_training_data
register_configs()
cfg = compose_job_config(sys.argv[1:])
data = build_training_data(cfg)
start, cpu = time.perf_counter(), time.process_time()
plan = data.sampler.plan(0)  # packing every example into bins, evening out and dealing them
plan_s, plan_cpu_s = time.perf_counter() - start, time.process_time() - cpu
_, first, _ = data.sampler.next_microbatch()
batch = data.collate(data.dataset, first, data.tokenizer.pad_token_id)
first_microbatch_at = time.time()
ds = data.dataset
n = len(ds) + (len(data.eval_dataset) if data.eval_dataset is not None else 0)
print(json.dumps({"examples": n, "tokens": ds.stats.tokens, "microbatches": plan.microbatches_per_rank,
                  "packed_examples": len(ds), "plan_s": plan_s, "plan_cpu_s": plan_cpu_s,
                  "first_microbatch_at": first_microbatch_at,
                  "imports_done_at": imports_done_at}))
"""

DATASETS_CHILD = """
import json, sys
import datasets
from transformers import AutoTokenizer
path, tok_dir, cache, num_proc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tokenizer = AutoTokenizer.from_pretrained(tok_dir)
def tokenize(batch):
    texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in batch["messages"]]
    return {"input_ids": tokenizer(texts, add_special_tokens=False)["input_ids"]}
ds = datasets.load_dataset("json", data_files=path, split="train", cache_dir=cache)
ds = ds.map(tokenize, batched=True, num_proc=num_proc, remove_columns=ds.column_names)
lengths = ds.with_format("arrow")["input_ids"].combine_chunks().value_lengths()
print(json.dumps({"examples": len(ds), "tokens": int(lengths.to_numpy().sum())}))
"""


RANK_CHILD = """
import json, os, sys, time
from pathlib import Path
from trainer.compose import compose_job_config, register_configs
from trainer.pipeline import build_training_data
rank, world, sync = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
register_configs()
data = build_training_data(compose_job_config(sys.argv[4:]), rank, world)
checksum = int(data.dataset.tokens.sum(dtype="int64"))  # every page of the token array read, as an epoch would
(sync / f"ready{rank}").touch()
while len(list(sync.glob("ready*"))) < world:  # measure while every rank holds its mapping
    time.sleep(0.1)
kb = {k: int(v.split()[0]) for k, v in (l.split(":", 1) for l in open("/proc/self/smaps_rollup") if l[0].isupper())}
time.sleep(1.0)
print(json.dumps({"rss": kb["Rss"] / 2**20, "pss": kb["Pss"] / 2**20,
                  "private": (kb["Private_Clean"] + kb["Private_Dirty"]) / 2**20, "checksum": checksum}))
"""


def ranks_sharing(overrides: list[str], env: dict[str, str], world: int, sync: Path) -> list[dict]:
    """``world`` ranks built from the warm cache at once; each one's RSS, PSS and private memory (GB)."""
    sync.mkdir(parents=True, exist_ok=True)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_CHILD, str(r), str(world), str(sync), *overrides],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
        )
        for r in range(world)
    ]
    return [json.loads(p.communicate()[0].decode().strip().splitlines()[-1]) for p in procs]


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (a snapshot of /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total


def run_child(code: str, args: list[str], env: dict[str, str]) -> dict:
    """Run ``code`` in a fresh interpreter; its JSON answer plus wall seconds and peak RSS (GB)."""
    start, started_at = time.perf_counter(), time.time()
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE)
    peak_tree, main_hwm, done = [0], [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak_tree[0] = max(peak_tree[0], tree_rss(proc.pid))
            main_hwm[0] = max(main_hwm[0], vm_hwm(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"child failed ({status}): {' '.join(args)}")
    answer = json.loads(out.decode().strip().splitlines()[-1])
    # ru_maxrss also counts the parent's peak when the child was started by vfork (exec records the old
    # mm's high-water mark), so the child's own VmHWM is preferred once sampled.
    peak = main_hwm[0] or usage.ru_maxrss * 1024
    if "first_microbatch_at" in answer:  # from the child's start (interpreter and imports included)
        answer["first_microbatch_s"] = answer["first_microbatch_at"] - started_at
        answer["imports_s"] = answer["imports_done_at"] - started_at
    return answer | {"wall_s": wall, "peak_rss_gb": peak / 2**30, "peak_tree_rss_gb": peak_tree[0] / 2**30}


def vm_hwm(pid: int) -> int:
    """The peak resident bytes of ``pid`` itself (VmHWM), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM")), 0)
    except OSError:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/packfsdp_data_scale"))
    parser.add_argument("--num-proc", type=int, default=2, help="workers of the datasets reference's map")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument(
        "--warm-only",
        type=Path,
        metavar="CACHE",
        help="only the warm run, on the data.cache_dir of an earlier run (e.g. after a code change)",
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for the packfsdp runs")
    markdown_argument(parser)
    args = parser.parse_args()
    with captured() as out:
        measure(args)
    publish(args.markdown, "benchmarks/data_scale.py", out.block())


def measure(args: argparse.Namespace) -> None:
    """Prepare the generated chats cold and warm (and the ``datasets`` reference), one line each."""

    work = args.workdir / str(args.records)
    work.mkdir(parents=True, exist_ok=True)
    data, tok_dir = work / "chats.jsonl", work / "tokenizer"
    if not data.is_file():
        start = time.perf_counter()
        write_chats(data, args.records)
        print(f"generated {args.records} chats in {time.perf_counter() - start:.1f} s")
    print(f"data: {data} ({data.stat().st_size / 1e6:.0f} MB); load average {load_average()}")
    if not (tok_dir / "tokenizer.json").is_file():
        print(f"BPE training on 20000 chats (excluded below): {train_tokenizer(data, tok_dir):.1f} s")

    cache = args.warm_only or work / f"cache-{time.time_ns()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    overrides = [
        "recipe=cpu_chat_sft",
        "data=jsonl",
        f"data.path={data}",
        f"model.tokenizer={tok_dir}",
        f"data.cache_dir={cache}",
        "logger.peak_tflops=1",
        *args.overrides,
    ]
    runs = {"packfsdp cold": (PACKFSDP_CHILD, overrides), "packfsdp warm": (PACKFSDP_CHILD, overrides)}
    if args.warm_only:
        del runs["packfsdp cold"]
    if not (args.skip_reference or args.warm_only):
        runs[f"datasets map num_proc={args.num_proc}"] = (
            DATASETS_CHILD,
            [str(data), str(tok_dir), str(cache / "hf-reference"), str(args.num_proc)],
        )
    print(
        f"{'run':<24} {'examples':>9} {'tokens':>11} {'wall s':>8} {'tokens/s':>10} {'peak RSS GB':>11} "
        f"{'tree RSS GB':>11}"
    )
    results = {}
    for name, (code, child_args) in runs.items():
        r = results[name] = run_child(code, child_args, env)
        print(
            f"{name:<24} {r['examples']:>9} {r['tokens']:>11} {r['wall_s']:>8.1f} {r['tokens'] / r['wall_s']:>10.0f} "
            f"{r['peak_rss_gb']:>11.2f} {r['peak_tree_rss_gb']:>11.2f}",
            flush=True,
        )
    warm = results["packfsdp warm"]
    print(
        f"warm cache: packing {warm['packed_examples']} examples into {warm['microbatches']} micro-batches "
        f"(the epoch plan) {warm['plan_s']:.2f} s ({warm['plan_cpu_s']:.2f} s of CPU); "
        f"process start to first micro-batch {warm['first_microbatch_s']:.1f} s "
        f"(of which interpreter start and imports of torch/transformers/datasets {warm['imports_s']:.1f} s)"
    )
    for rank, r in enumerate([] if args.warm_only else ranks_sharing(overrides, env, 2, cache / "sync")):
        print(
            f"2 ranks from the warm cache, rank {rank}: RSS {r['rss']:.2f} GB, PSS {r['pss']:.2f} GB, "
            f"private {r['private']:.2f} GB (every token page read)"
        )
    print(f"load average at the end {load_average()}")
    print(
        textwrap.dedent(f"""\
        peak RSS: the child's main process (VmHWM); tree RSS: the child's process tree summed
        (sampled every 0.2 s; pages of a shared mapping count once per process). Cache: {cache}""")
    )


if __name__ == "__main__":
    main()
