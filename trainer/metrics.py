"""Stage 7: metrics. The typed record of a training step, the console, ``metrics.jsonl`` and wandb.

Honest counting: ``useful_tokens`` are tokens that carry a label (the loss is computed on them); pads,
filler micro-batches, the first token of each example and prompt tokens masked out of the loss never count.
``padding_fraction`` is the share of computed positions that hold no real token. Every count is summed over
all ranks by the trainer before it reaches this module.

``metrics.jsonl`` (one ``StepMetrics`` per logged step) and ``eval.jsonl`` (one ``EvalMetrics`` per eval)
are the serialisations of these records: this module writes them and reads them back (``read_metrics``,
``read_evals``) for the tools; their JSON keys are the field names.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from trainer.config import LoggerConfig
from trainer.safety import RedactingFilter, redact_argv

if TYPE_CHECKING:  # torch stays out of the tools that only read records (compare, summarize)
    from typing import Self  # Python 3.11+; annotations only, so 3.10 imports this module too

    import torch

    from trainer.throughput import StepCounts

log = logging.getLogger("trainer")

METRICS_FILE = "metrics.jsonl"
"""One JSON record per logged training step, in the run directory; this module is its only writer."""
EVAL_FILE = "eval.jsonl"
"""One JSON record per eval on the held-out split, in the run directory."""
SUMMARY_FILE = "summary.json"
"""The run's averages and settings (``RunSummary.result`` and more), written by rank 0 when the run ends."""


# ------------------------------------------------------------------------------------------ padding ratios
def padding_fraction(tokens: float, positions: float) -> float:
    """Share of the computed positions that hold no real token (pads, filler micro-batches)."""
    return 1 - tokens / positions if positions else 0.0


def padding_saved_fraction(positions: float, padded_equivalent_positions: float) -> float:
    """Share of the positions a padded run of the same examples would compute that this run did not."""
    return 1 - positions / padded_equivalent_positions if padded_equivalent_positions else 0.0


def useful_fraction(useful_tokens: float, positions: float) -> float:
    """Share of the computed positions whose token carries a label (the loss is computed on it)."""
    return useful_tokens / positions if positions else 0.0


# ------------------------------------------------------------------------------------------------- records
def utc_iso(unix_time: float) -> str:
    """Wall-clock time as ISO 8601 in UTC, to the millisecond (``2026-11-30T21:43:02.123+00:00``)."""
    return datetime.fromtimestamp(unix_time, timezone.utc).isoformat(timespec="milliseconds")


class JsonRecord:
    """A dataclass that is one line of a JSONL file: its JSON keys are its field names. The logger stamps
    each record's ``time`` (wall clock, ISO 8601 UTC) and ``elapsed_s`` (since this process started the
    run; a resumed attempt counts from its own start) as it writes it."""

    time: str | None
    elapsed_s: float | None

    def stamp(self, started: float) -> None:
        now = time.time()
        self.time, self.elapsed_s = utc_iso(now), round(now - started, 3)

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        for key in (
            "preference",
            "distill",
            "cp_skew",
            "token_loss",
            "aux_loss",
        ):  # the records keep the keys they always had
            if record.get(key, ...) is None:
                del record[key]
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Self:
        """The record a JSON line holds; derived fields are computed again, unknown keys ignored."""
        return cls(**{f.name: record[f.name] for f in fields(cls) if f.init and f.name in record})


@dataclass
class StepMetrics(JsonRecord):
    """One optimizer step, over all ranks: what it trained on, what it computed, how long it took.

    Built once per step by ``StepMetrics.measure`` in the train loop; one line of ``metrics.jsonl``.
    """

    step: int
    """Optimizer steps done, this one included (1-based)."""
    epoch: int
    """The sampler epoch the step's micro-batches came from (0-based)."""
    loss: float
    """Mean token cross-entropy: summed token loss over every micro-batch and rank / global label tokens (with a
    router aux loss, the objective trained: ``token_loss + coef * aux_loss``, transformers' ``outputs.loss``).
    0 on a step with no label token, NaN on a step skipped as non-finite."""
    lr: float
    """Learning rate the step used (the scheduler advances after it)."""
    grad_norm: float
    """Global gradient norm over all shards and ranks, before clipping (NaN or Inf when a gradient is)."""
    useful_tokens: int
    """Label tokens trained on, over all micro-batches and ranks; 0 when the step was skipped (a skipped
    step trains on nothing). Pads, filler, the first token of each example and masked prompts never count."""
    tokens: int
    """Real tokens (label or not) in the step's micro-batches over all ranks: positions minus pads and filler."""
    positions: int
    """Positions the model computed over all ranks, pads and filler included."""
    useful_tokens_per_s: float = field(init=False)
    """``useful_tokens / step_time_s``: the headline throughput."""
    tokens_per_s: float = field(init=False)
    """``tokens / step_time_s``."""
    padding_fraction: float = field(init=False)
    """Share of ``positions`` that hold no real token (see ``padding_fraction()``)."""
    padded_equivalent_positions: int
    """Positions padded micro-batches of the same examples would compute (examples x longest, summed over
    micro-batches and ranks); equals ``positions`` in a padded run."""
    padding_saved_fraction: float = field(init=False)
    """Share of ``padded_equivalent_positions`` that packing did not compute (see ``padding_saved_fraction()``)."""
    model_flops: float
    """Forward + backward model FLOPs on real tokens over all ranks (see ``trainer.throughput``)."""
    step_time_s: float
    """Wall-clock seconds of the step on this rank (rank 0 logs): batches, collectives, forward, backward,
    optimizer step."""
    peak_mem_gib: float
    """This rank's peak memory so far (rank 0 logs), GiB: the CUDA allocator's peak on GPU, the peak resident
    set on CPU."""
    skipped: str | None = None
    """Why the update was not applied on any rank: ``"no_labels"`` or ``"nonfinite"``; ``None``: applied."""
    tokens_seen: int | None = None
    """``useful_tokens`` summed over the run so far, this step included (restored on resume). ``None`` only
    in records written before it was logged."""
    token_loss: float | None = None
    """With a router aux loss (``trainer.router_aux``): the mean token cross-entropy alone; ``None`` without."""
    aux_loss: float | None = None
    """With a router aux loss: the step's load-balancing loss (unscaled; each micro-batch's weighed by its share of
    the step's real tokens); ``None`` without."""
    cp_skew: float | None = None
    """Context parallel (``parallel.cp > 1``): the step's attention-cost skew across each CP group (the busiest
    rank's causal attention pairs over the group's mean, minus 1; mean over groups). ``None`` without CP."""
    time: str | None = None
    """Wall-clock time the record was written (ISO 8601, UTC): lines steps up with outside monitoring."""
    elapsed_s: float | None = None
    """Seconds since this process started the run (a resumed attempt counts from its own start)."""
    preference: dict[str, float] | None = None
    """``objective=dpo``: the step's TRL-named metrics over all ranks (``rewards/chosen``, ``rewards/rejected``,
    ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``; ``trainer.objectives.dpo``);
    ``loss`` is then the mean pair loss."""
    distill: dict[str, float] | None = None
    """``objective=distill``: the parts of the step's loss, each a mean over the label tokens: ``cross_entropy``
    (the SFT loss of the same tokens) and ``divergence`` (``trainer.objectives.distill``)."""

    def __post_init__(self) -> None:
        self.useful_tokens_per_s = self.useful_tokens / self.step_time_s
        self.tokens_per_s = self.tokens / self.step_time_s
        self.padding_fraction = padding_fraction(self.tokens, self.positions)
        self.padding_saved_fraction = padding_saved_fraction(self.positions, self.padded_equivalent_positions)

    @classmethod
    def measure(
        cls,
        counts: StepCounts,
        *,
        step: int,
        epoch: int,
        loss: float,
        lr: float,
        grad_norm: float,
        skipped: str | None,
        step_time_s: float,
        model_flops: float,
        peak_mem_gib: float,
        tokens_seen_before: int,
        **fields: Any,
    ) -> StepMetrics:
        """The record of a step from its all-reduced ``counts`` and its ``loss`` over all ranks; ``fields``: what the
        objective (``token_loss``, ``aux_loss``, ``preference``) and the parallel route (``cp_skew``) add."""
        useful = 0 if skipped else int(counts.label_tokens)  # a skipped step trained on nothing: count nothing
        return cls(
            step=step,
            epoch=epoch,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            useful_tokens=useful,
            tokens=int(counts.tokens),
            positions=int(counts.positions),
            padded_equivalent_positions=int(counts.padded_equivalent_positions),
            model_flops=model_flops,
            step_time_s=step_time_s,
            peak_mem_gib=peak_mem_gib,
            skipped=skipped,
            tokens_seen=tokens_seen_before + useful,
            **fields,
        )


@dataclass
class EvalMetrics(JsonRecord):
    """One eval on the held-out split (packed batches, every rank); one line of ``eval.jsonl``."""

    step: int
    """Optimizer steps done when the eval ran."""
    eval_loss: float
    """Mean token cross-entropy over every held-out label token of every rank (never a router aux loss: the
    held-out loss stays the token loss)."""
    eval_tokens: int
    """Held-out label tokens over all ranks."""
    eval_time_s: float
    """Wall-clock seconds of the eval on this rank."""
    time: str | None = None
    """Wall-clock time the record was written (ISO 8601, UTC)."""
    elapsed_s: float | None = None
    """Seconds since this process started the run."""
    preference: dict[str, float] | None = None
    """``objective=dpo``: the held-out pairs' TRL-named metrics (``eval_rewards/accuracies``, ...);
    ``eval_loss`` is then the mean pair loss."""
    distill: dict[str, float] | None = None
    """``objective=distill``: ``eval_cross_entropy`` and ``eval_divergence`` of the held-out label tokens."""


def setup_logging(rank: int) -> None:
    """One logger; rank 0 logs at INFO, other ranks only warnings and errors."""
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = (
        "%(asctime)s [%(levelname)s] %(message)s"
        if rank == 0
        else f"%(asctime)s [rank {rank} %(levelname)s] %(message)s"
    )
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
        import transformers  # noqa: PLC0415 -- the tools that only read records (compare, summarize) import no transformers

        transformers.logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        import torch  # noqa: PLC0415 -- the tools that only read records (compare, summarize) import no torch

        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


@dataclass
class RunSummary:
    """Averages over the logged steps after the first ``skip`` (warm-up)."""

    skip: int
    steps: list[StepMetrics] = field(default_factory=list)
    evals: list[EvalMetrics] = field(default_factory=list)

    def add(self, metrics: StepMetrics) -> None:
        self.steps.append(metrics)

    def add_eval(self, metrics: EvalMetrics) -> None:
        self.evals.append(metrics)

    def result(self, peak_tflops_total: float = float("nan")) -> dict[str, Any]:
        """Averages over the kept steps; ``peak_tflops_total`` (all devices) turns model FLOPs into MFU."""
        kept = self.steps[self.skip :] or self.steps
        if not kept:
            return {}
        trained = [m for m in self.steps if not m.skipped] or self.steps  # skipped steps' loss is NaN
        time_s = sum(m.step_time_s for m in kept)
        useful = sum(m.useful_tokens for m in kept)
        tokens = sum(m.tokens for m in kept)
        positions = sum(m.positions for m in kept)
        padded_equivalent = sum(m.padded_equivalent_positions for m in kept)
        model_tflops_per_s = sum(m.model_flops for m in kept) / time_s / 1e12
        return {
            "steps": len(self.steps),
            "steps_averaged": len(kept),
            "useful_tokens_per_s": useful / time_s,
            "tokens_per_s": tokens / time_s,
            "padding_fraction": padding_fraction(tokens, positions),
            "useful_fraction": useful_fraction(useful, positions),
            "mean_step_time_s": time_s / len(kept),
            "padded_equivalent_positions": padded_equivalent,
            "padding_saved_fraction": padding_saved_fraction(positions, padded_equivalent),
            "model_tflops_per_s": model_tflops_per_s,
            "mfu": model_flops_utilization(model_tflops_per_s, peak_tflops_total),
            "final_loss": trained[-1].loss,
            **(
                {}
                if trained[-1].aux_loss is None
                else {"final_token_loss": trained[-1].token_loss, "final_aux_loss": trained[-1].aux_loss}
            ),
            "final_eval_loss": self.evals[-1].eval_loss if self.evals else float("nan"),
            "peak_mem_gib": max(m.peak_mem_gib for m in self.steps),
        } | self.preference_result()

    def preference_result(self) -> dict[str, Any]:
        """The objective's own metrics of the last step and the last eval (``final_`` prefixed): ``objective=dpo``'s
        TRL-named ones, ``objective=distill``'s parts of the loss."""
        out = {}
        for key in ("preference", "distill"):
            last = getattr(self.steps[-1], key) if self.steps else None
            last_eval = getattr(self.evals[-1], key) if self.evals else None
            out |= {f"final_{k}": v for k, v in (last or {}).items()} | {
                f"final_{k}": v for k, v in (last_eval or {}).items()
            }
        return out


def model_flops_utilization(model_tflops_per_s: float, peak_tflops_total: float) -> float:
    """Achieved / peak model FLOPs; NaN when the peak is unknown (a CPU), or below what the run achieved
    (a wrong ``logger.peak_tflops``: reporting more than 100% would be a wrong figure, not a fast run)."""
    if not peak_tflops_total > 0:
        return float("nan")
    mfu = model_tflops_per_s / peak_tflops_total
    if mfu > 1.0:
        log.warning(
            "MFU not reported: the run achieved %.3g model TFLOP/s, more than the peak of %.3g (set "
            "logger.peak_tflops to the device's real peak)",
            model_tflops_per_s,
            peak_tflops_total,
        )
        return float("nan")
    return mfu


class MetricsLogger:
    """Writes one record per logged step to ``metrics.jsonl`` (always), the console and wandb (optional).
    Only rank 0 writes; other ranks' calls are no-ops."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, enabled: bool, run_config: dict | None = None) -> None:
        self.cfg, self.enabled = cfg, enabled
        self.started = time.time()
        self.path = run_dir / METRICS_FILE
        self.eval_path = run_dir / EVAL_FILE
        self._file = open(self.path, "a", encoding="utf-8") if enabled else None
        self._eval_file = None  # opened on the first eval, so runs without eval leave no empty file
        self._wandb = None
        if enabled and cfg.wandb and cfg.wandb_mode != "disabled":
            self._wandb = init_wandb(cfg, run_dir, run_config or {})

    def log(self, metrics: StepMetrics) -> None:
        if not self.enabled:
            return
        metrics.stamp(self.started)
        record = metrics.to_json()
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=metrics.step)
        log.info(format_step(metrics))

    def log_eval(self, metrics: EvalMetrics) -> None:
        """An eval record in ``eval.jsonl`` (``metrics.jsonl`` stays one record per training step), and in
        wandb under the same names (``eval_loss``, ...) at the training step it follows."""
        if not self.enabled:
            return
        if self._eval_file is None:
            self._eval_file = open(self.eval_path, "a", encoding="utf-8")
        metrics.stamp(self.started)
        record = metrics.to_json()
        self._eval_file.write(json.dumps(record) + "\n")
        self._eval_file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k not in ("step", "time")}, step=metrics.step)
        log.info(
            "eval  %5d | loss %.4f on %d held-out tokens (%.1f s)%s",
            metrics.step,
            metrics.eval_loss,
            metrics.eval_tokens,
            metrics.eval_time_s,
            ""
            if not metrics.preference
            else " | {} pairs, reward acc {:.3f} margin {:.4f}".format(
                metrics.preference["eval_pairs"],
                metrics.preference["eval_rewards/accuracies"],
                metrics.preference["eval_rewards/margins"],
            )
            + (
                ""
                if not metrics.distill
                else " | ce {eval_cross_entropy:.4f} div {eval_divergence:.4f}".format(**metrics.distill)
            ),
        )

    def wall_clock(self) -> dict[str, Any]:
        """When this process started the run and when it ended (now), for ``summary.json``."""
        now = time.time()
        return {
            "started_at": utc_iso(self.started),
            "ended_at": utc_iso(now),
            "wall_time_s": round(now - self.started, 3),
        }

    def close(self) -> None:
        for f in (self._file, self._eval_file):
            if f:
                f.close()
        if self._wandb is not None:
            self._wandb.finish()


def trim_metrics(run_dir: Path, step: int) -> None:
    """Drop ``metrics.jsonl`` and ``eval.jsonl`` records after ``step`` (logged by an attempt that died before
    its next checkpoint): the resumed run logs those steps again, once."""
    for name in (METRICS_FILE, EVAL_FILE):
        path = Path(run_dir) / name
        if not path.is_file():
            continue
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


def read_metrics(run_dir: Path) -> list[StepMetrics]:
    """The training steps ``metrics.jsonl`` of ``run_dir`` holds (none if it has no such file)."""
    return [StepMetrics.from_json(r) for r in _read_jsonl(Path(run_dir) / METRICS_FILE)]


def read_evals(run_dir: Path) -> list[EvalMetrics]:
    """The evals ``eval.jsonl`` of ``run_dir`` holds (none if the run had no eval)."""
    return [EvalMetrics.from_json(r) for r in _read_jsonl(Path(run_dir) / EVAL_FILE)]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def init_wandb(cfg: LoggerConfig, run_dir: Path, run_config: dict):
    """A wandb run logging next to the JSONL. Offline needs neither network nor key; an online run that
    cannot start (no key, no network) says so loudly and continues offline rather than killing training."""
    import wandb  # noqa: PLC0415 -- optional (logger.wandb=true): the wandb extra

    os.environ.setdefault("WANDB_SILENT", "true")
    sys.argv[1:] = redact_argv(sys.argv[1:])  # wandb stores the command line in its run files
    kwargs = dict(project=cfg.wandb_project, dir=str(run_dir), config=run_config, name=run_dir.name)
    try:
        return wandb.init(mode=cfg.wandb_mode, **kwargs)
    except Exception as e:  # wandb raises several types for auth and network failures
        if cfg.wandb_mode != "online":
            raise
        log.warning(
            "wandb online failed (%s: %s); logging offline instead (sync later with `wandb sync`)", type(e).__name__, e
        )
        return wandb.init(mode="offline", **kwargs)


class ProgressBar:
    """A tqdm bar on rank 0 (steps, useful tokens/s, loss, ETA). tqdm shows it only on a terminal; the
    log lines go through ``tqdm.write`` meanwhile so they print above the bar instead of through it."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self._bar = None
        self._redirect = None

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            self._bar = tqdm(total=self.total, unit="step", dynamic_ncols=True, disable=None, file=sys.stderr)
            if not self._bar.disable:
                self._redirect = logging_redirect_tqdm(loggers=[logging.getLogger()])
                self._redirect.__enter__()
        return self

    def update(self, metrics: StepMetrics) -> None:
        if self._bar is None:
            return
        self._bar.set_postfix_str(
            f"useful tok/s {metrics.useful_tokens_per_s:,.0f} | loss {metrics.loss:.3f}", refresh=False
        )
        self._bar.update(1)

    def __exit__(self, *exc) -> None:
        if self._redirect is not None:
            self._redirect.__exit__(*exc)
        if self._bar is not None:
            self._bar.close()


def format_step(m: StepMetrics) -> str:
    return (
        f"step {m.step:>5} | loss {m.loss:.4f} | lr {m.lr:.2e} | gnorm {m.grad_norm:.3f} | "
        f"useful tok/s {m.useful_tokens_per_s:,.0f} | pad {100 * m.padding_fraction:.1f}% | "
        f"saved {100 * m.padding_saved_fraction:.1f}% | "
        f"step {1000 * m.step_time_s:.0f} ms | mem {m.peak_mem_gib:.2f} GiB"
        + (f" | token {m.token_loss:.4f} aux {m.aux_loss:.4f}" if m.aux_loss is not None else "")
        + (f" | cp skew {100 * m.cp_skew:.1f}%" if m.cp_skew is not None else "")
        + (f" | SKIPPED ({m.skipped})" if m.skipped else "")
        + (
            " | reward acc {:.3f} margin {:.4f}".format(
                m.preference["rewards/accuracies"], m.preference["rewards/margins"]
            )
            if m.preference
            else ""
        )
        + (" | ce {cross_entropy:.4f} div {divergence:.4f}".format(**m.distill) if m.distill else "")
    )
