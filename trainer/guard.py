"""The training loop's safety net: bad steps and failures that must end the job on every rank.

**Bad steps** (``StepGuard``). After the backward passes, one all-reduce carries the step's loss sum and one
flag per rank (loss not finite: 1, gradient norm not finite: 2), so every rank reaches the same verdict:

- no label token on any rank: the step is skipped (its loss and gradients are exactly zero) and logged;
- a NaN/Inf on any rank: ``guard.nonfinite=skip`` skips it on every rank (``optimizer.step`` does not run,
  so parameters and optimizer state are unchanged; the lr schedule still advances, as it follows the step
  count) and logs the ranks; ``stop`` (or too many skips in a row) raises ``TrainingHalted`` naming the step.

**Failures** (``describe_failure``). Any exception ends the job with one line per rank on stderr and a
non-zero exit, never a hang: the failing rank records its reason in the c10d store, so a rank whose
collective broke because a peer died says which rank failed and why; a rank stuck in a collective gives up
after ``guard.collective_timeout_s``. An out-of-memory error says what to lower. The entry point then leaves
with ``os._exit`` (no barrier, no process-group destructor that could wait on a dead peer), and torchrun
tears the rest down and may restart the job.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from trainer import distributed
from trainer.config import ConfigError, GuardConfig
from trainer.data.bad_records import BadRecordError
from trainer.errors import AttentionBackendError, LoadError, SelfCheckError
from trainer.safety import UnsafeFileError, printable, redact

log = logging.getLogger("trainer")


class TrainingHalted(RuntimeError):
    """The run stopped on purpose, on every rank together (a non-finite step under ``guard.nonfinite=stop``)."""


class JobFailed(Exception):
    """What the entry point prints (one line) and exits with."""

    def __init__(self, message: str, exit_code: int = 1, own: bool = True, together: bool = False) -> None:
        super().__init__(message)
        self.exit_code, self.own = exit_code, own
        self.together = together
        """Every rank fails the same way at the same point (a halted step, a config or data error)."""


# ----------------------------------------------------------------------------------------------- bad steps
@dataclass
class StepVerdict:
    loss_sum: float
    """The step's summed token loss over all ranks."""
    skip: str | None = None
    """``None`` (apply the update), ``"no_labels"`` or ``"nonfinite"``."""


class StepGuard:
    """Decides, identically on every rank, whether a step's update is applied."""

    def __init__(self, cfg: GuardConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.skipped = {"no_labels": 0, "nonfinite": 0}
        self.consecutive_nonfinite = 0

    def check(self, step: int, local_loss_sum: float, grad_norm: float, global_labels: float) -> StepVerdict:
        """One all-reduce: the global loss sum and which ranks saw a non-finite loss or gradient norm."""
        world, rank = distributed.world_size(), distributed.rank()
        flags = [0.0] * world
        flags[rank] = (0.0 if math.isfinite(local_loss_sum) else 1.0) + (0.0 if math.isfinite(grad_norm) else 2.0)
        loss_sum, *flags = distributed.all_reduce_sum([local_loss_sum, *flags], self.device)
        bad = {r: int(f) for r, f in enumerate(flags) if f}
        if bad:
            return self._nonfinite(step, bad)
        self.consecutive_nonfinite = 0
        if global_labels == 0:
            self.skipped["no_labels"] += 1
            log.warning("step %d: no label token on any rank; optimizer step skipped on every rank", step)
            return StepVerdict(loss_sum, "no_labels")
        return StepVerdict(loss_sum)

    def _nonfinite(self, step: int, bad: dict[int, int]) -> StepVerdict:
        what = "; ".join(
            f"rank {r}: " + " and ".join(n for bit, n in ((1, "loss"), (2, "gradient norm")) if f & bit) + " not finite"
            for r, f in sorted(bad.items())
        )
        self.consecutive_nonfinite += 1
        self.skipped["nonfinite"] += 1
        if self.cfg.nonfinite == "stop":
            raise TrainingHalted(
                f"step {step}: {what} (guard.nonfinite=stop). Lower optim.lr, tighten optim.grad_clip or check "
                "this step's data; guard.nonfinite=skip skips such steps"
            )
        if self.consecutive_nonfinite >= self.cfg.max_consecutive_skips:
            raise TrainingHalted(
                f"step {step}: {what}; {self.consecutive_nonfinite} non-finite steps in a row "
                f"(guard.max_consecutive_skips={self.cfg.max_consecutive_skips}): the run has diverged"
            )
        log.warning("step %d: %s; step skipped on every rank (parameters and optimizer state unchanged)", step, what)
        return StepVerdict(float("nan"), "nonfinite")


# ------------------------------------------------------------------------------------------------ failures
_COLLECTIVE_SIGNS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "peer")


def describe_failure(exc: BaseException, where: str, timeout_s: float) -> JobFailed:
    """Turn any exception raised on this rank into the one line the entry point prints, and record it in the
    shared store when it is this rank's own fault (so the others can name it)."""
    rank = distributed.rank()
    text = printable(redact(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__))
    if isinstance(exc, (ConfigError, AttentionBackendError, UnsafeFileError, BadRecordError)):  # LoadError too
        # Fix the config or the data, then run again: a restart alone would fail the same way (exit code 2).
        kinds = {  # most specific first: a LoadError is a ConfigError
            LoadError: "load error",
            ConfigError: "config error",
            BadRecordError: "data error",
            AttentionBackendError: "attention backend error",
        }
        kind = next((k for cls, k in kinds.items() if isinstance(exc, cls)), "error")
        failure = _own(rank, f"{kind}: {text}", exit_code=2)
        failure.together = True
        return failure
    if isinstance(exc, SelfCheckError):  # the attention backend disagrees with the reference: exit code 3
        failure = _own(rank, text, exit_code=3)
        failure.together = True
        return failure
    if isinstance(exc, TrainingHalted):  # every rank raised it together: nothing to blame on a peer
        return JobFailed(f"rank {rank}: stopped: {text}", own=False, together=True)
    if isinstance(exc, torch.OutOfMemoryError):
        return _own(
            rank,
            f"rank {rank}: out of memory at {where}: {text}. Lower packing.token_budget or grad_accum (or use "
            "activation checkpointing); a restart with resume=auto continues from the last checkpoint",
        )
    peers = distributed.peer_failures()
    if peers:
        first = min(peers)
        return JobFailed(f"rank {rank}: stopping at {where} because rank {first} failed: {peers[first]}", own=False)
    if any(sign in text.lower() for sign in _COLLECTIVE_SIGNS) and distributed.world_size() > 1:
        silent = distributed.silent_peers(stale_s=3 * distributed.heartbeat_interval(timeout_s))
        who = "; ".join(silent) if silent else "another rank stopped answering or died"
        return JobFailed(
            f"rank {rank}: a collective failed at {where} (guard.collective_timeout_s={timeout_s:g}): {who}; "
            f"exiting so the launcher can restart the job ({text})",
            own=False,
        )
    return _own(rank, f"rank {rank}: {type(exc).__name__} at {where}: {text}")


def _own(rank: int, message: str, exit_code: int = 1) -> JobFailed:
    distributed.record_failure(message.removeprefix(f"rank {rank}: "))
    return JobFailed(message, exit_code)
