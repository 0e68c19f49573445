"""Faults the tests inject into a real Trainer: the library's step carries no hook, the test wraps what it breaks.

``FaultyTrainer`` is the ``Trainer`` with its phases wrapped; ``Faults("kind@step[:rank],...", rank)`` says what
misbehaves at optimizer step ``step`` (1-based) on ``rank`` (all ranks when omitted):

- ``hang``: the rank sleeps as the step starts, holding up every collective;
- ``no_labels``: every label of the step's micro-batches is masked (before the step's counts are all-reduced);
- ``oom``: ``torch.OutOfMemoryError`` as a micro-batch's forward starts;
- ``nan_loss``: the micro-batch's loss, so its gradients too, becomes NaN;
- ``nan_grad``: this rank's shard of the first gradient becomes NaN after backward.

In a test's own process: ``inject(trainer, spec)`` on a ``FaultyTrainer`` (the ``trainer`` fixture is one). Under
torchrun: ``python -m tests.faults.fault_entry OVERRIDES`` with ``PFTEST_FAULT=spec`` runs ``trainer.train`` with
the ``FaultyTrainer``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from trainer.collate import Batch
from trainer.data.examples import IGNORE_INDEX
from trainer.loop import Trainer
from trainer.objectives import MicroLoss

log = logging.getLogger("trainer")

FAULT_ENV = "PFTEST_FAULT"
FAULT_KINDS = ("nan_loss", "nan_grad", "no_labels", "oom", "hang")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None


def parse_faults(spec: str) -> list[Fault]:
    """``"nan_loss@3:1,hang@5"`` -> faults; a malformed spec is an error (a test that injects nothing passes
    for the wrong reason)."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            kind, _, rest = item.partition("@")
            step, _, rank = rest.partition(":")
            fault = Fault(kind, int(step), int(rank) if rank else None)
        except ValueError:
            raise ValueError(f"{FAULT_ENV}: cannot read {item!r}; expected kind@step[:rank]") from None
        if fault.kind not in FAULT_KINDS:
            raise ValueError(f"{FAULT_ENV}: unknown fault {fault.kind!r}; choose one of: {', '.join(FAULT_KINDS)}")
        faults.append(fault)
    return faults


class Faults:
    """This rank's faults of a spec, and the kinds due at the current step."""

    def __init__(self, spec: str | None, rank: int) -> None:
        self.faults = [f for f in parse_faults(spec or "") if f.rank in (None, rank)]
        self.now: frozenset[str] = frozenset()

    def start_step(self, step: int) -> None:
        self.now = frozenset(f.kind for f in self.faults if f.step == step)
        if "hang" in self.now:
            time.sleep(1e6)

    def __contains__(self, kind: str) -> bool:
        return kind in self.now


def mask_labels(batch: Batch) -> None:
    batch.labels.fill_(IGNORE_INDEX)
    batch.num_label_tokens = 0


def poison_first_gradient(model: torch.nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            grad.fill_(float("nan"))
            return


class FaultyTrainer(Trainer):
    """The Trainer, with ``self.faults`` acting at its phases: the step (``hang``), its micro-batches
    (``no_labels``), each forward/backward (``oom``, ``nan_loss``, ``nan_grad``)."""

    faults = Faults(None, 0)

    def train_step(self):
        self.faults.start_step(self.step + 1)
        return super().train_step()

    def next_step_batches(self) -> list[Batch]:
        batches = super().next_step_batches()
        if "no_labels" in self.faults:
            for batch in batches:
                mask_labels(batch)
        return batches

    def forward_backward(self, batch: Batch, counts) -> torch.Tensor:
        if "oom" in self.faults:
            raise torch.OutOfMemoryError(f"injected out-of-memory ({__name__})")
        if "nan_loss" in self.faults:
            loss = self.objective.loss
            self.objective.loss = lambda *args: MicroLoss(*(t * float("nan") for t in loss(*args)))
        try:
            loss_sum = super().forward_backward(batch, counts)
        finally:
            vars(self.objective).pop("loss", None)
        if "nan_grad" in self.faults:  # after each backward: the last one leaves it NaN for the clip and the guard
            poison_first_gradient(self.model)
        return loss_sum


def inject(trainer: FaultyTrainer, spec: str) -> None:
    """Make ``trainer`` (this process's rank) misbehave as ``spec`` says; ``NEXT`` stands for its next step."""
    trainer.faults = Faults(spec.replace("NEXT", str(trainer.step + 1)), trainer.rank)
    log.warning("fault injection active: %s", spec)
