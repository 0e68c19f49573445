"""Issue 33's measured cases (figures: docs/failures.md, "Signals, hangs and input at scale"), each a real run
of the trainer on generated input, from the repository root:

    python benchmarks/input_and_signals.py sigterm-bpe         # SIGTERM to torchrun while the local BPE trains
    python benchmarks/input_and_signals.py huge-line --mb 200  # 100 short lines and one line of MB megabytes
    python benchmarks/input_and_signals.py many-files --files 2000

``sigterm-bpe``: 3 lines of 2 MB of random words (the tokenizers trainer's merge phase takes tens of seconds),
2 ranks; SIGTERM to torchrun 3 s into the training; prints the seconds until each rank's line and until
torchrun exits. The others: one rank, ``max_steps=1``; prints the wall time and the peak resident memory of
the run (``/usr/bin/time -v``'s figure, from ``getrusage`` of the children). Inputs and caches go to a fresh
temporary folder (``--keep DIR`` to choose it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN = ["-m", "trainer.train", "recipe=cpu_dailydialog", "data.source=jsonl"]


def env(cache: Path) -> dict:
    return os.environ | {"PACKFSDP_CACHE": str(cache), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def sigterm_bpe(folder: Path) -> None:
    rng = random.Random(0)
    letters = "abcdefghij klmnop qrstuvwxyz"
    data = folder / "bpe.jsonl"
    data.write_text("".join(json.dumps({"text": "".join(rng.choices(letters, k=2_000_000))}) + "\n" for _ in range(3)))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        *TRAIN,
        f"data.path={data}",
        "max_steps=2",
        f"run_dir={folder / 'run'}",
    ]
    proc = subprocess.Popen(cmd, env=env(folder / "cache"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sent = None
    for line in proc.stdout:
        if sent is None and "training a byte-level BPE tokenizer" in line:
            time.sleep(3)  # inside the Rust trainer's merge phase
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        elif sent is not None and line.startswith("packfsdp:"):
            print(f"+{time.monotonic() - sent:5.1f} s  {line.strip()[:100]}")
    proc.wait()
    print(f"+{time.monotonic() - sent:5.1f} s  torchrun exited (rc {proc.returncode})")


def timed_run(folder: Path, data: Path) -> None:
    cmd = [sys.executable, *TRAIN, f"data.path={data}", "max_steps=1", f"run_dir={folder / 'run'}"]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env(folder / "cache"), capture_output=True, text=True)
    wall = time.monotonic() - start
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    for line in (proc.stdout + proc.stderr).splitlines():
        if "over data.max_record_bytes" in line or "records ->" in line or line.startswith("packfsdp:"):
            print(line[:200])
    print(f"rc {proc.returncode}: {wall:.1f} s wall, peak RSS {peak_gb:.2f} GB")


def huge_line(folder: Path, mb: int) -> None:
    data = folder / "huge.jsonl"
    chunk = "lorem ipsum dolor sit amet consectetur " * 1000
    with open(data, "w") as f:
        f.writelines(json.dumps({"text": f"a normal document number {i} " * 5}) + "\n" for i in range(100))
        f.write('{"text": "' + chunk * (mb * 1_000_000 // len(chunk)) + '"}\n')
    timed_run(folder, data)


def many_files(folder: Path, files: int) -> None:
    data = folder / "shards"
    data.mkdir()
    for i in range(files):
        chat = [
            {"role": "user", "content": f"question {i} about things"},
            {"role": "assistant", "content": f"answer {i} with words"},
        ]
        (data / f"part{i:05d}.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    timed_run(folder, data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=("sigterm-bpe", "huge-line", "many-files"))
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--keep", type=Path, help="work folder (default: a temporary one, removed after)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        if args.case == "sigterm-bpe":
            sigterm_bpe(folder)
        elif args.case == "huge-line":
            huge_line(folder, args.mb)
        else:
            many_files(folder, args.files)


if __name__ == "__main__":
    main()
