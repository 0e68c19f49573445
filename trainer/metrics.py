"""Stage 7: metrics. Console, a JSONL file in the run directory, and wandb when asked.

Honest counting: ``useful_tokens`` are tokens that carry a label (the loss is computed on them); pads,
filler micro-batches, the first token of each example and prompt tokens masked out of the loss never count.
``padding_fraction`` is the share of computed positions that hold no real token. Both are summed over all
ranks by the trainer before they reach this module.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.config import LoggerConfig

log = logging.getLogger("trainer")


def setup_logging(rank: int) -> None:
    """One logger; rank 0 logs at INFO, other ranks only warnings and errors."""
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = "%(asctime)s [%(levelname)s] %(message)s" if rank == 0 else f"%(asctime)s [rank {rank} %(levelname)s] %(message)s"
    root = logging.getLogger()
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
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

    def add(self, metrics: dict) -> None:
        self.steps.append(metrics)

    def result(self) -> dict[str, Any]:
        kept = self.steps[self.skip :] or self.steps
        if not kept:
            return {}
        time_s = sum(m["step_time_s"] for m in kept)
        useful = sum(m["useful_tokens"] for m in kept)
        tokens = sum(m["tokens"] for m in kept)
        positions = sum(m["positions"] for m in kept)
        return {
            "steps": len(self.steps),
            "steps_averaged": len(kept),
            "useful_tokens_per_s": useful / time_s,
            "tokens_per_s": tokens / time_s,
            "padding_fraction": 1 - tokens / positions if positions else 0.0,
            "useful_fraction": useful / positions if positions else 0.0,
            "mean_step_time_s": time_s / len(kept),
            "final_loss": self.steps[-1]["loss"],
            "peak_mem_gib": max(m["peak_mem_gib"] for m in self.steps),
        }


class MetricsLogger:
    """Writes one record per logged step to ``metrics.jsonl`` (always), the console and wandb (optional).
    Only rank 0 writes; other ranks' calls are no-ops."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, enabled: bool, run_config: dict | None = None) -> None:
        self.cfg, self.enabled = cfg, enabled
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8") if enabled else None
        self._wandb = None
        if enabled and cfg.wandb and cfg.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(
                project=cfg.wandb_project, mode=cfg.wandb_mode, dir=str(run_dir), config=run_config or {},
                name=run_dir.name,
            )

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=metrics["step"])
        log.info(format_step(metrics))

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def format_step(m: dict[str, Any]) -> str:
    return (
        f"step {m['step']:>5} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.3f} | "
        f"useful tok/s {m['useful_tokens_per_s']:,.0f} | pad {100 * m['padding_fraction']:.1f}% | "
        f"step {1000 * m['step_time_s']:.0f} ms | mem {m['peak_mem_gib']:.2f} GiB"
    )


def finite_or_nan(x: float) -> float:
    return x if math.isfinite(x) else float("nan")
