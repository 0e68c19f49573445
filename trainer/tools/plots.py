"""PNG plots of a comparison (matplotlib, no display needed): loss curves, useful tokens/s, variability."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # files only: no display on training machines
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from trainer.metrics import EvalMetrics, StepMetrics

COLORS = {"packed": "tab:blue", "padded": "tab:orange"}
_FIGSIZE, _DPI = (6.4, 3.6), 100  # small PNGs (~30-50 kB) that still read well in a README


def plot_loss(
    steps: dict[str, list[StepMetrics]],
    evals: dict[str, list[EvalMetrics]],
    path: Path,
    title: str = "",
    unigram_entropy: float | None = None,
) -> Path:
    """Train loss per step (lines) and held-out eval loss (markers) of every run on one axis; the unigram
    entropy of the training tokens, when given, as a dashed line (what learning from context goes below)."""
    fig, ax = plt.subplots(figsize=_FIGSIZE, dpi=_DPI)
    for name, records in steps.items():
        color = COLORS.get(name)
        ax.plot([m.step for m in records], [m.loss for m in records], label=f"{name} train", color=color, lw=1.4)
        if run_evals := evals.get(name):
            ax.plot(
                [e.step for e in run_evals],
                [e.eval_loss for e in run_evals],
                "o--",
                label=f"{name} eval",
                color=color,
                ms=4,
                lw=0.8,
            )
    if unigram_entropy is not None and math.isfinite(unigram_entropy):
        ax.axhline(unigram_entropy, color="gray", ls="--", lw=1, label=f"unigram entropy {unigram_entropy:.2f}")
    ax.set(xlabel="optimizer step", ylabel="loss (mean token cross-entropy)", title=title or "Loss: packed vs padded")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_throughput(
    steps: dict[str, list[StepMetrics]], path: Path, summaries: dict[str, dict], title: str = ""
) -> Path:
    """Useful tokens/s per step of every run, with the run's mean (after warm-up) as a dashed line."""
    fig, ax = plt.subplots(figsize=_FIGSIZE, dpi=_DPI)
    for name, records in steps.items():
        color = COLORS.get(name)
        ax.plot(
            [m.step for m in records],
            [m.useful_tokens_per_s for m in records],
            label=name,
            color=color,
            lw=1.2,
            alpha=0.8,
        )
        mean = summaries.get(name, {}).get("useful_tokens_per_s")
        if mean:
            ax.axhline(mean, color=color, ls="--", lw=1, label=f"{name} mean {mean:,.0f}")
    ax.set(xlabel="optimizer step", ylabel="useful tokens / s", title=title or "Useful tokens/s: packed vs padded")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_variability(rows: list[dict], path: Path, title: str = "") -> Path:
    """Measured packed/padded speedup against the coefficient of variation of example length."""
    fig, ax = plt.subplots(figsize=_FIGSIZE, dpi=_DPI)
    rows = sorted(rows, key=lambda r: r["cv"])
    cvs = [r["cv"] for r in rows]
    speedups = [r["speedup"] for r in rows]
    ax.plot(cvs, speedups, "o-", color=COLORS["packed"])
    for r in rows:
        ax.annotate(r["name"], (r["cv"], r["speedup"]), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set(
        xlabel="coefficient of variation of example length (std / mean)",
        ylabel="speedup (useful tokens/s, packed / padded)",
        title=title or "Packing speedup vs length variability (equal mean length)",
    )
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
