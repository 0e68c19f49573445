"""Stage 7: metrics. Console, a JSONL file in the run directory, and wandb when asked.

Honest counting: ``useful_tokens`` are tokens that carry a label (the loss is computed on them); pads,
filler micro-batches, the first token of each example and prompt tokens masked out of the loss never count.
``padding_fraction`` is the share of computed positions that hold no real token. Both are summed over all
ranks by the trainer before they reach this module.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.config import LoggerConfig
from trainer.safety import RedactingFilter, redact_argv

log = logging.getLogger("trainer")

METRICS_FILE = "metrics.jsonl"
"""One JSON record per logged training step, in the run directory; this module is its only writer."""
EVAL_FILE = "eval.jsonl"


def setup_logging(rank: int) -> None:
    """One logger; rank 0 logs at INFO, other ranks only warnings and errors."""
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = "%(asctime)s [%(levelname)s] %(message)s" if rank == 0 else f"%(asctime)s [rank {rank} %(levelname)s] %(message)s"
    root = logging.getLogger()
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    handler.addFilter(RedactingFilter())  # API keys never reach a log line
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("transformers", "datasets", "httpx", "urllib3", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


@dataclass
class RunSummary:
    """Averages over the logged steps after the first ``skip`` (warm-up)."""

    skip: int
    steps: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)

    def add(self, metrics: dict) -> None:
        self.steps.append(metrics)

    def add_eval(self, metrics: dict) -> None:
        self.evals.append(metrics)

    def result(self, peak_tflops_total: float = float("nan")) -> dict[str, Any]:
        """Averages over the kept steps; ``peak_tflops_total`` (all devices) turns model FLOPs into MFU."""
        kept = self.steps[self.skip :] or self.steps
        if not kept:
            return {}
        trained = [m for m in self.steps if not m.get("skipped")] or self.steps  # skipped steps' loss is NaN
        time_s = sum(m["step_time_s"] for m in kept)
        useful = sum(m["useful_tokens"] for m in kept)
        tokens = sum(m["tokens"] for m in kept)
        positions = sum(m["positions"] for m in kept)
        padded_equivalent = sum(m.get("padded_equivalent_positions", m["positions"]) for m in kept)
        model_tflops_per_s = sum(m.get("model_flops", 0.0) for m in kept) / time_s / 1e12
        return {
            "steps": len(self.steps),
            "steps_averaged": len(kept),
            "useful_tokens_per_s": useful / time_s,
            "tokens_per_s": tokens / time_s,
            "padding_fraction": 1 - tokens / positions if positions else 0.0,
            "useful_fraction": useful / positions if positions else 0.0,
            "mean_step_time_s": time_s / len(kept),
            "padded_equivalent_positions": padded_equivalent,
            "padding_saved_fraction": 1 - positions / padded_equivalent if padded_equivalent else 0.0,
            "model_tflops_per_s": model_tflops_per_s,
            "mfu": model_tflops_per_s / peak_tflops_total if peak_tflops_total > 0 else float("nan"),
            "final_loss": trained[-1]["loss"],
            "final_eval_loss": self.evals[-1]["eval_loss"] if self.evals else float("nan"),
            "peak_mem_gib": max(m["peak_mem_gib"] for m in self.steps),
        }


class MetricsLogger:
    """Writes one record per logged step to ``metrics.jsonl`` (always), the console and wandb (optional).
    Only rank 0 writes; other ranks' calls are no-ops."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, enabled: bool, run_config: dict | None = None) -> None:
        self.cfg, self.enabled = cfg, enabled
        self.path = run_dir / METRICS_FILE
        self.eval_path = run_dir / EVAL_FILE
        self._file = open(self.path, "a", encoding="utf-8") if enabled else None
        self._eval_file = None  # opened on the first eval, so runs without eval leave no empty file
        self._wandb = None
        if enabled and cfg.wandb and cfg.wandb_mode != "disabled":
            self._wandb = init_wandb(cfg, run_dir, run_config or {})

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=metrics["step"])
        log.info(format_step(metrics))

    def log_eval(self, metrics: dict[str, Any]) -> None:
        """An eval record in ``eval.jsonl`` (``metrics.jsonl`` stays one record per training step), and in
        wandb under the same names (``eval_loss``, ...) at the training step it follows."""
        if not self.enabled:
            return
        if self._eval_file is None:
            self._eval_file = open(self.eval_path, "a", encoding="utf-8")
        self._eval_file.write(json.dumps(metrics) + "\n")
        self._eval_file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])
        log.info(
            "eval  %5d | loss %.4f on %d held-out tokens (%.1f s)",
            metrics["step"], metrics["eval_loss"], metrics["eval_tokens"], metrics["eval_time_s"],
        )

    def close(self) -> None:
        for f in (self._file, self._eval_file):
            if f:
                f.close()
        if self._wandb is not None:
            self._wandb.finish()


def trim_metrics(run_dir: Path, step: int) -> None:
    """Drop ``metrics.jsonl`` records after ``step`` (logged by an attempt that died before its next
    checkpoint): the resumed run logs those steps again, once."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:  # a line cut short when the attempt died
            continue
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def init_wandb(cfg: LoggerConfig, run_dir: Path, run_config: dict):
    """A wandb run logging next to the JSONL. Offline needs neither network nor key; an online run that
    cannot start (no key, no network) says so loudly and continues offline rather than killing training."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    sys.argv[1:] = redact_argv(sys.argv[1:])  # wandb stores the command line in its run files
    kwargs = dict(project=cfg.wandb_project, dir=str(run_dir), config=run_config, name=run_dir.name)
    try:
        return wandb.init(mode=cfg.wandb_mode, **kwargs)
    except Exception as e:  # wandb raises several types for auth and network failures
        if cfg.wandb_mode != "online":
            raise
        log.warning("wandb online failed (%s: %s); logging offline instead (sync later with `wandb sync`)",
                    type(e).__name__, e)
        return wandb.init(mode="offline", **kwargs)


class ProgressBar:
    """A tqdm bar on rank 0 (steps, useful tokens/s, loss, ETA). tqdm shows it only on a terminal; the
    log lines go through ``tqdm.write`` meanwhile so they print above the bar instead of through it."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self._bar = None
        self._redirect = None

    def __enter__(self) -> "ProgressBar":
        if self.enabled:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=self.total, unit="step", dynamic_ncols=True, disable=None, file=sys.stderr)
            if not self._bar.disable:
                self._redirect = logging_redirect_tqdm(loggers=[logging.getLogger()])
                self._redirect.__enter__()
        return self

    def update(self, metrics: dict[str, Any]) -> None:
        if self._bar is None:
            return
        self._bar.set_postfix_str(f"useful tok/s {metrics['useful_tokens_per_s']:,.0f} | loss {metrics['loss']:.3f}",
                                  refresh=False)
        self._bar.update(1)

    def __exit__(self, *exc) -> None:
        if self._redirect is not None:
            self._redirect.__exit__(*exc)
        if self._bar is not None:
            self._bar.close()


def format_step(m: dict[str, Any]) -> str:
    return (
        f"step {m['step']:>5} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.3f} | "
        f"useful tok/s {m['useful_tokens_per_s']:,.0f} | pad {100 * m['padding_fraction']:.1f}% | "
        f"saved {100 * m.get('padding_saved_fraction', 0.0):.1f}% | "
        f"step {1000 * m['step_time_s']:.0f} ms | mem {m['peak_mem_gib']:.2f} GiB"
        + (f" | SKIPPED ({m['skipped']})" if m.get("skipped") else "")
    )
