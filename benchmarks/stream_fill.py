"""Fill of online buffered best fit (``data.stream.enabled=true``) against global best-fit decreasing.

    python benchmarks/stream_fill.py [--budgets 512 1024 2048] [--windows 64 256 1024 4096]

Tokenizes the DailyDialog-like synthetic set (13,118 dialogs, the local BPE tokenizer, cached) as the
trainer does, then packs its lengths in stream order two ways: global BFD over the whole set
(``packing.strategy=bfd``) and ``OnlineBestFit`` with a window of N examples (the stream drained at the
end). Prints fill (tokens / (bins x budget)) and bins for each; ``--markdown FILE`` also writes them as this
benchmark's section of FILE (the figures of ``docs/data.md``: ``docs/figures/data.md``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.figures import captured, markdown_argument, publish
from trainer.config import DataConfig, ModelConfig
from trainer.data import load_dataset, load_tokenizer
from trainer.packing import PackParams, pack
from trainer.packing.online import OnlineBestFit


def online_fill(lengths: np.ndarray, budget: int, window: int) -> tuple[int, float]:
    """(bins, fill) of ``OnlineBestFit`` fed ``lengths`` in order, then drained."""
    packer, bins, placed = OnlineBestFit(budget, window), 0, 0
    for i, n in enumerate(lengths.tolist()):
        packer.add(i, n)
        if packer.full:
            placed += sum(lengths[packer.next_bin()].tolist())
            bins += 1
    while len(packer):
        placed += sum(lengths[packer.next_bin()].tolist())
        bins += 1
    assert placed == int(lengths.sum())  # every example placed exactly once
    return bins, placed / (bins * budget)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--windows", type=int, nargs="+", default=[64, 256, 1024, 4096])
    markdown_argument(parser)
    args = parser.parse_args()
    data_cfg = DataConfig()
    tokenizer = load_tokenizer(ModelConfig(), data_cfg)
    with captured() as out:
        fills(args, data_cfg, tokenizer)
    publish(args.markdown, "benchmarks/stream_fill.py", out.block())


def fills(args: argparse.Namespace, data_cfg: DataConfig, tokenizer) -> None:
    """Global BFD and online best fit at every window, for every budget: one line each."""
    for budget in args.budgets:
        lengths = np.asarray(load_dataset(data_cfg, tokenizer, max_length=budget).lengths, dtype=np.int64)
        glob = pack(lengths, "bfd", PackParams(budget), np.random.default_rng(0)).stats
        print(f"DailyDialog-like, {len(lengths)} examples, mean {lengths.mean():.1f} tokens, budget {budget}")
        print(f"  global BFD        : {glob.bins:6d} bins, fill {100 * glob.fill:6.2f}%")
        for window in args.windows:
            bins, fill = online_fill(lengths, budget, window)
            print(
                f"  online, window {window:5d}: {bins:6d} bins, fill {100 * fill:6.2f}% "
                f"({100 * fill / glob.fill:6.2f}% of global BFD)"
            )


if __name__ == "__main__":
    main()
