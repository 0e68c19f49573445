"""What verifying the tokenized cache costs when it is opened (``trainer/data/cache_integrity.py``), and the
check a run makes after each step that the files it maps did not change (``check_unchanged``), at 1M
generated examples (lengths 2-255): ``python benchmarks/cache_check_cost.py [FOLDER] [--markdown FILE]``. Figures:
docs/figures/data.md."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.figures import captured, markdown_argument, publish
from trainer.data.arrays import ArrayWriter, open_arrays
from trainer.data.cache_integrity import CHECKSUMS, check_consistent, check_files, seal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", type=Path, default=Path("/tmp/packfsdp_cache_check_cost"))
    markdown_argument(parser)
    args = parser.parse_args()
    with captured() as out:
        measure(args.folder)
    publish(args.markdown, "benchmarks/cache_check_cost.py", out.block())


def measure(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    rng = np.random.default_rng(0)
    writer = ArrayWriter(folder)
    for _ in range(10):
        lengths = rng.integers(2, 256, 100_000)
        n = int(lengths.sum())
        writer.add(rng.integers(0, 50000, n).astype(np.int32), rng.random(n) < 0.6, lengths)
    writer.finish()
    t = time.perf_counter()
    seal(folder)
    sealed = time.perf_counter() - t
    size = sum(p.stat().st_size for p in folder.iterdir())
    for _ in range(2):  # the second: warm page cache, as a restart finds it
        t = time.perf_counter()
        check_files(folder, json.loads((folder / CHECKSUMS).read_text()))
        sums = time.perf_counter() - t
        t = time.perf_counter()
        check_consistent(folder, 256)
        consistent = time.perf_counter() - t
        t = time.perf_counter()
        open_arrays(folder)
        mapped = time.perf_counter() - t
        print(
            f"1M examples, {size / 2**20:.0f} MiB: seal {sealed:.2f} s; open check: checksums {sums:.2f} s + "
            f"consistency {consistent:.2f} s; open_arrays alone {mapped:.3f} s"
        )
    dataset, calls = open_arrays(folder), 100_000
    t = time.perf_counter()
    for _ in range(calls):
        dataset.check_unchanged()
    print(f"per step, while a run maps it: check_unchanged {(time.perf_counter() - t) / calls * 1e6:.1f} us")
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
