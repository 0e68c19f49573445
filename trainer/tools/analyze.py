"""The packing report, before training: ``packfsdp analyze recipe=NAME [key=value ...] [--png PATH]``.

Reports on the examples training sees: built by ``trainer.pipeline.build_training_data`` exactly as the
trainer builds them (same truncation, same cache, the eval hold-out removed), then prints:
- the length histogram (also drawn as a PNG, default ``outputs/analyze/<name>_lengths.png``);
- the padding overhead of padded batching at the recipe's batch size (the padded baseline's examples per
  micro-batch: ``packing.padded_batch_size``, or matched to the packed run as the trainer does; a
  preference pair is two rows, each padded to the micro-batch's widest sequence, as ``collate_padded`` pads it);
- every strategy's bins and fill rate against the lower bound ``ceil(total tokens / budget)``;
- the rank balance (max/mean skew of useful tokens per optimizer step) at a few world sizes;
- the largest speedup packing can give on this data: positions a padded run computes / real tokens.

Extra flags (besides Hydra overrides): ``--png PATH``, ``--world-sizes 2,8``.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from trainer.cli import check_group_choices
from trainer.compose import compose_job_config, register_configs
from trainer.config import ConfigError, JobConfig
from trainer.data.examples import pair_splits_of
from trainer.metrics import setup_logging
from trainer.packing import STRATEGIES, MicroBatchSampler, matched_padded_batch_size, pack, pack_params


def useful_tokens_counter(dataset):
    """``bin -> label tokens`` for whole-example bins and piece bins alike (a piece's first token has none).
    Whole examples read only the stored label counts; a piece reads its own slice of the mask."""
    counts = dataset.label_counts()

    def useful(bin_: np.ndarray) -> int:
        if bin_.ndim == 1:
            return int(counts[bin_].sum())
        return sum(int(dataset.example(int(i))[1][lo + 1 : hi].sum()) for i, lo, hi in bin_)

    return useful


def text_histogram(lengths: np.ndarray, buckets: int = 16, width: int = 50) -> list[str]:
    edges = np.linspace(0, int(lengths.max()) + 1, buckets + 1).round().astype(int)
    counts, _ = np.histogram(lengths, bins=edges)
    top = max(int(counts.max()), 1)
    return [
        f"  {lo:>6}-{hi - 1:<6} {c:>8}  {'#' * math.ceil(width * c / top) if c else ''}"
        for lo, hi, c in zip(edges[:-1], edges[1:], counts, strict=True)
    ]


def draw_histogram(lengths: np.ndarray, budget: int, title: str, path: Path) -> None:
    import matplotlib  # noqa: PLC0415 -- heavy, for the histogram only: after the command line's checks

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 -- with matplotlib above

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.hist(lengths, bins=60, color="#4477aa")
    ax.axvline(float(lengths.mean()), color="#228833", ls="--", label=f"mean {lengths.mean():.0f}")
    if budget <= lengths.max() * 1.5:
        ax.axvline(budget, color="#cc3311", label=f"token budget {budget}")
    ax.set_xlabel("tokens per example")
    ax.set_ylabel("examples")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def packing_report(dataset, cfg: JobConfig, world_sizes: list[int], cost=None) -> tuple[list[str], dict]:
    """The report's lines and its figures (a dict, for tests and scripts); ``cost``: the model's
    ``TokenCost`` when ``packing.balance=flops`` (``trainer.pipeline.balance_cost``)."""
    lengths, budget, seed = dataset.lengths, cfg.packing.token_budget, cfg.seed
    pair_splits = pair_splits_of(dataset)  # pairs: costed and padded as their two sequences
    total, useful = int(lengths.sum()), useful_tokens_counter(dataset)
    batch_size = cfg.packing.padded_batch_size or matched_padded_batch_size(lengths, cfg.packing, seed)
    lower = math.ceil(total / budget)
    lines = report_header(dataset, cfg, batch_size, lower, pair_splits)
    figures: dict = {
        "examples": len(lengths),
        "tokens": total,
        "lower_bound": lower,
        "batch_size": batch_size,
        "strategies": {},
    }
    rows = [
        f"  {'strategy':<10} {'micro-batches':>13} {'fill':>8} {'vs bound':>9} {'positions':>11} "
        f"{'pad overhead':>12} {'pos/token':>9} " + " ".join(f"{'skew@' + str(w):>8}" for w in world_sizes)
    ]
    # a pair is packed whole: the strategies that cut examples are refused for pairs (JobConfig), so not shown
    names = [n for n in STRATEGIES if pair_splits is None or not STRATEGIES[n].splits]
    for name in names:
        pcfg = replace(cfg.packing, strategy=name)  # the report's lengths may exceed the budget: drop, counted
        result = pack(
            lengths, name, pack_params(pcfg, batch_size, "drop"), np.random.default_rng([seed, 0, 0]), pair_splits
        )
        s = result.stats
        skews, worst = rank_skews(lengths, cfg, pcfg, world_sizes, batch_size, useful, cost, pair_splits)
        padded = STRATEGIES[name].padded
        fill = "-" if padded else f"{100 * s.fill:.2f}%"
        bound = "-" if padded else f"{100 * s.efficiency:.2f}%"
        rows.append(
            f"  {name:<10} {s.bins:>13} {fill:>8} {bound:>9} {s.positions:>11} "
            f"{100 * s.padding_overhead:>11.1f}% {s.positions / total:>9.2f} "
            + " ".join(f"{100 * k:>7.2f}%" for k in skews)
        )
        figures["strategies"][name] = s.as_dict() | {
            "skew": dict(zip(world_sizes, skews, strict=True)),
            "worst_step_skew": dict(zip(world_sizes, worst, strict=True)),
        }
    lines += rows + mixture_lines(dataset, cfg, figures)
    figures["max_speedup"] = figures["strategies"]["none"]["positions"] / total
    return lines + report_legend(figures, cfg, pair_splits is not None), figures


def report_header(dataset, cfg: JobConfig, batch_size: int, lower: int, pair_splits) -> list[str]:
    """The report's opening lines: the examples' sizes against the token budget and the ``lower`` bound of
    bins, their length histogram, and the padded batching the strategies are measured against."""
    lengths, budget, total = dataset.lengths, cfg.packing.token_budget, int(dataset.lengths.sum())
    lines = [
        f"packing report: {cfg.name} | {len(lengths)} examples, {total} tokens, "
        f"{int(dataset.label_counts().sum())} label tokens",
        f"lengths: mean {lengths.mean():.1f}, median {np.median(lengths):.0f}, p99 {np.percentile(lengths, 99):.0f}, "
        f"max {lengths.max()} | token budget {budget} | lower bound ceil({total}/{budget}) = {lower} bins",
        "",
        "length histogram (tokens: examples)",
        *text_histogram(lengths),
        "",
        f"padded batching at the recipe's batch size ({batch_size} "
        f"{'examples' if pair_splits is None else f'pairs ({2 * batch_size} rows)'} per micro-batch, "
        f"{'set' if cfg.packing.padded_batch_size else 'matched to the packed run'}):",
    ]
    if pair_splits is not None:
        lines[-1:-1] = [
            f"the examples are preference pairs: {2 * len(lengths)} sequences, each its own segment "
            "(packed) or row (padded); strategies that cut examples are not shown (a pair is packed whole)",
            "",
        ]
    return lines


def rank_skews(
    lengths: np.ndarray, cfg: JobConfig, pcfg, world_sizes: list[int], batch_size: int, useful, cost, pair_splits
) -> tuple[list[float], list[float]]:
    """The rank balance of the packing ``pcfg`` at each of ``world_sizes``, in the first epoch, of the useful
    tokens ``useful`` counts: the skew over all steps, and that of the worst single step."""
    skews, worst = [], []
    for w in world_sizes:
        sampler = MicroBatchSampler(
            lengths,
            pcfg,
            0,
            w,
            cfg.seed,
            padded_batch_size=batch_size,
            grad_accum=cfg.grad_accum,
            oversize="drop",
            cost=cost,
            pair_splits=pair_splits,
        )
        balance = sampler.balance_report(0, weight=useful)
        skews.append(balance["skew"])
        worst.append(balance["worst_step_skew"])
    return skews, worst


def report_legend(figures: dict, cfg: JobConfig, pairs: bool) -> list[str]:
    """The report's closing lines: what each column means and the largest speedup packing can give, from the
    report's ``figures`` (``pairs``: the examples are preference pairs)."""
    total = figures["tokens"]
    return [
        "",
        "fill = real tokens / (micro-batches x budget); vs bound = lower bound / micro-batches (100% is optimal);",
        "positions = what the model computes (padded: rows x longest row"
        + ("; a pair is two rows, one per sequence" if pairs else "")
        + "); pos/token = positions / real tokens;",
        f"skew@W = sum over steps of the busiest rank's useful tokens / sum of the mean, minus 1, over W ranks"
        f" (grad_accum {cfg.grad_accum}); the worst single step (bfd: "
        + ", ".join(f"{100 * k:.1f}% @{w}" for w, k in figures["strategies"]["bfd"]["worst_step_skew"].items())
        + ") is a step holding one of the few part-filled bins.",
        f"largest speedup packing can give here: {figures['max_speedup']:.2f}x over shuffled padded batches "
        f"(computes {figures['strategies']['none']['positions']} positions for {total} tokens), "
        f"{figures['strategies']['sorted']['positions'] / total:.2f}x over length-grouped ones.",
    ]


def mixture_lines(dataset, cfg: JobConfig, figures: dict) -> list[str]:
    """The shares of a ``data.mixture`` of sources (nothing for one source); its figures go to
    ``figures["mix"]``."""
    if not hasattr(dataset, "shares"):
        return []
    figures["mix"] = dataset.shares()
    return ["", f"mixture (data.mixture.by={cfg.data.mixture.by}, seed {cfg.data.seed}):"] + [
        f"  {s['source']:<40} {s['examples']:>9} examples ({s['unique_examples']} unique) "
        f"{100 * s['example_share']:>6.2f}% of examples {100 * s['token_share']:>6.2f}% of tokens"
        for s in figures["mix"]
    ]


def parse_args(argv: list[str]) -> tuple[list[str], Path | None, list[int]]:
    overrides, png, worlds = [], None, [2, 8]
    it = iter(argv)
    for arg in it:
        if arg.startswith("--png"):
            png = Path(arg.split("=", 1)[1] if "=" in arg else next(it))
        elif arg.startswith("--world-sizes"):
            value = arg.split("=", 1)[1] if "=" in arg else next(it)
            worlds = [int(w) for w in value.split(",")]
        else:
            overrides.append(arg)
    return overrides, png, worlds


def run(argv: list[str]) -> dict:
    """Print the report on the examples training sees (the eval hold-out removed); return its figures."""
    from trainer.pipeline import build_training_data  # noqa: PLC0415 -- heavy (the model package): after the command line's checks

    overrides, png, worlds = parse_args(argv)
    setup_logging(0)
    logging.getLogger("trainer.packing").setLevel(logging.WARNING)  # the report prints its own figures
    cfg = compose_job_config(overrides)
    if cfg.data.stream.enabled:
        raise ConfigError(
            "analyze reports on the whole dataset, which a stream never holds; run it without "
            "data.stream.enabled (benchmarks/stream_fill.py measures the online packing's fill)"
        )
    data = build_training_data(cfg)
    dataset = data.dataset
    lines, figures = packing_report(dataset, cfg, worlds, data.sampler.cost)
    png = png or Path(cfg.output_root) / "analyze" / f"{cfg.name}_lengths.png"
    draw_histogram(dataset.lengths, cfg.packing.token_budget, f"{cfg.name}: {len(dataset)} examples", png)
    lines.append(f"histogram: {png}")
    print("\n".join(lines))
    return figures | {"png": str(png)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    register_configs()
    check_group_choices(argv)
    try:
        run(argv)
    except ConfigError as e:
        print(f"packfsdp: config error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
