"""Packing speed and quality on 1M example lengths (a script, not a test).

    python benchmarks/pack_speed.py [--n 1000000] [--budgets 1024,2048,4096] [--repeat 3] [--no-trl]

For the DailyDialog-like and a heavy-tailed length distribution (``trainer.data.synthetic``) at each
budget, prints every strategy's seconds (best of ``--repeat``) for ``trainer.packing.pack`` (lengths ->
bins, the whole job: bad-input checks, kernel, per-bin arrays, stats) and its fill against the lower bound
``ceil(total tokens / budget)``. Whole-example strategies get lengths truncated to the budget (as the
trainer truncates); ``bfd_split`` and ``wrapped`` get the raw lengths.

When ``trl`` is installed (it is not a dependency of packfsdp), TRL's ``pack_dataset(..., strategy="bfd")``
runs on the same truncated lengths in the same process: once as TRL runs by default (``datasets.map`` batches
of 1000 examples, so it packs each window of 1000 separately) and once over the whole dataset in one batch
(the same problem packfsdp solves). Its time includes building the packed arrow columns, which packfsdp
defers to the collate step; its input is a list column of 1-byte tokens to keep that cost small.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.figures import captured, markdown_argument, publish
from trainer.data.synthetic import WORKLOADS
from trainer.packing import PackParams, pack

STRATEGIES = ("none", "sorted", "ffd", "bfd", "bfd_split", "wrapped")


def best_time(fn, repeat: int):
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def trl_pack(lengths: np.ndarray, budget: int, window: int | None) -> tuple[float, int]:
    """Seconds and packed rows of TRL's bfd on these lengths (``window``: its map batch size)."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable
    from trl import pack_dataset

    datasets.disable_progress_bars()
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = pa.array(np.zeros(int(offsets[-1]), dtype=np.int8))
    column = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    ds = datasets.Dataset(InMemoryTable(pa.table({"input_ids": column})))
    kwargs = {"batch_size": window or len(lengths)}
    start = time.perf_counter()
    packed = pack_dataset(ds, seq_length=budget, strategy="bfd", map_kwargs=kwargs)
    return time.perf_counter() - start, len(packed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--budgets", default="1024,2048,4096")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    markdown_argument(ap)
    args = ap.parse_args()
    with captured() as out:
        measure(args)
    publish(args.markdown, "benchmarks/pack_speed.py", out.block())


def measure(args: argparse.Namespace) -> None:
    """Every strategy (and TRL's bfd) on every workload and budget, one line each."""
    try:
        import trl

        have_trl = not args.no_trl
        trl_version = trl.__version__
    except ImportError:
        have_trl, trl_version = False, None
    print(f"pack_speed: n={args.n}, best of {args.repeat}; trl {'v' + trl_version if have_trl else 'not run'}")

    for workload in args.workloads.split(","):
        raw = WORKLOADS[workload](args.n, args.seed)
        print(
            f"\n{workload}: mean {raw.mean():.1f}, p50 {np.median(raw):.0f}, p99 {np.percentile(raw, 99):.0f}, "
            f"max {raw.max()} tokens"
        )
        print(
            f"  {'budget':>6} {'strategy':<10} {'seconds':>8} {'bins':>9} {'bound':>9} {'fill':>8} "
            f"{'vs bound':>9} {'pad overh.':>10}"
        )
        for budget in (int(b) for b in args.budgets.split(",")):
            clipped = np.minimum(raw, budget)
            results = {}
            for name in STRATEGIES:
                lengths = raw if name in ("bfd_split", "wrapped") else clipped
                params = PackParams(budget, batch_size=max(1, round(budget / clipped.mean())))
                seconds, result = best_time(
                    lambda lengths=lengths, name=name, params=params: pack(
                        lengths, name, params, np.random.default_rng(0)
                    ),
                    args.repeat,
                )
                s = result.stats
                results[name] = seconds
                fill = "-" if name in ("none", "sorted") else f"{100 * s.fill:.2f}%"
                bound = "-" if name in ("none", "sorted") else f"{100 * s.efficiency:.2f}%"
                print(
                    f"  {budget:>6} {name:<10} {seconds:>8.3f} {s.bins:>9} {s.lower_bound:>9} {fill:>8} {bound:>9} "
                    f"{100 * s.padding_overhead:>9.1f}%"
                )
            if have_trl:
                lower = math.ceil(int(clipped.sum()) / budget)
                for label, window in (("trl bfd (map batches of 1000)", 1000), ("trl bfd (whole dataset)", None)):
                    seconds, rows = trl_pack(clipped, budget, window)
                    print(
                        f"  {budget:>6} {label:<30} {seconds:8.3f}s {rows:>9} bins, vs bound {100 * lower / rows:.2f}% "
                        f"| packfsdp bfd is {seconds / results['bfd']:.1f}x faster"
                    )


if __name__ == "__main__":
    main()
