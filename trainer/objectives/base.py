"""The objective's protocol: what the training loop, eval and the startup self-check ask of an objective.

An objective (``Objective``) is what a run optimises. The loop never asks which one runs: it builds the one
``objective=`` names (``trainer.objectives.build_objective``) and, per optimizer step::

    counts = StepCounts.of(batches, objective.units).all_reduced()   # the step's ONE all-reduce of counts
    for batch in batches:
        loss = objective.loss(model, batch, counts)                  # MicroLoss(loss_sum, objective)
        loss.objective.backward()
    metrics = objective.step_metrics(global_loss_sum, counts, device)

What a third objective implements (``sft.py`` and ``dpo.py`` are the two worked examples):

- ``name`` (the ``objective=`` value, also in ``trainer.config.OBJECTIVES``) and ``pairs``: what its batches must
  carry (``True``: preference pairs, sequences ``2k``/``2k + 1``; ``False``: examples). The data route is the
  same; the pipeline refuses data of the other kind in one line.
- ``__init__(cfg, model)``: read its config section (``cfg.<name>``), refuse what it cannot train exactly (one
  ``ConfigError`` line), ask the wrapper to record what it needs. ``model``: the unsharded ``VarlenCausalLM``,
  on its device, with its loss implementation picked, before the startup self-check.
- ``units(batch)``: what one micro-batch adds to the step's denominator (SFT: label tokens; DPO: pairs). The
  loop sums it over micro-batches and ranks with the step's other counts (``StepCounts.units``), so the loss
  is the GLOBAL mean, whatever the packing, the world size or the micro-batch count.
- ``loss_sum(model, batch)``: the micro-batch's summed loss (fp32 scalar with grad), asking the wrapper for the
  pass it needs (``VarlenCausalLM.token_loss``, ``sequence_logps`` or ``label_hidden`` for its own chunked
  loss, never full logits of a long row). A filler micro-batch (no unit) must give exactly 0 and still run
  the model (its collectives line up with the other ranks'). Metric sums (``sum_names``) are added with
  ``add_sums`` and read, all-reduced, by ``step_metrics`` through ``step_sums``.
- ``loss(model, batch, counts)``: the default divides ``loss_sum`` by ``counts.units`` (global); an
  objective that carries an additive term (the router aux loss, ``trainer.objectives.sft``) adds its share.
- ``step_metrics(loss_sum, counts, device)``: the step's record fields: ``loss`` (the global loss sum over the
  global units, plus any term) and the objective's own (at most one all-reduce); resets its sums.
- ``evaluate(model, dataset, token_budget, device, pad_id, route)``: the held-out loss and metrics
  (``eval_loss``, ``eval_tokens``, ``eval_time_s``, optional ``preference``), every rank taking part,
  micro-batches dealt as in training: ``trainer.evaluate.eval_sums`` walks them, calling
  a per-batch function of named sums, and all-reduces them once; the objective turns them into its metrics.
- ``check_loss()``: the loss the startup self-check differentiates (``trainer.model.certification``'s loss of the
  check: ``group``, ``describe``, ``packed``, ``alone``, as ``TokenLossCheck`` and ``dpo.PairLossCheck`` have
  them, and optionally ``token_losses``, as ``distill.DistillLossCheck``), the same loss through the run's path
  and from each sequence alone;
  ``check_indices``: the self-check's batch from the worst-case indices (whole pairs for DPO).
- ``setup(model, run)``: shard the policy (``run.shard``) and build what the objective holds beside it (a
  frozen reference or teacher, sharded like the policy: ``run.shard(copy, frozen=True)``; a pass over the
  data before training). Called once, after the self-check, before the optimizer is built.
- ``describe()``: the start-up log line.

Adding an objective is then one module here, registered in ``trainer/objectives/__init__.py``, its config
section (``trainer/config/training.py``, a ``JobConfig`` field and its name in ``OBJECTIVES``), a recipe and
its tests; the loop, eval, the self-check and the metrics stay as they are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np
import torch

from trainer import distributed
from trainer.collate import Batch
from trainer.throughput import StepCounts

if TYPE_CHECKING:
    from trainer.config import JobConfig
    from trainer.data.examples import TokenizedDataset


class MicroLoss(NamedTuple):
    """One micro-batch's loss, as the loop takes it."""

    loss_sum: torch.Tensor
    """The summed loss over the micro-batch's units (fp32 scalar): the guard checks it is finite, the logged loss
    is its sum over micro-batches and ranks over the global units."""
    objective: torch.Tensor
    """What backward runs: the micro-batch's share of the step's objective (``loss_sum`` over the GLOBAL units,
    plus the share of any additive term)."""


@dataclass
class RunSetup:
    """What ``Objective.setup`` may use of the run: how the policy is sharded and the data it trains on."""

    shard: Callable[..., torch.nn.Module]
    """``shard(model, frozen=False)``: FSDP2 as the run applies it (``frozen=True``: no activation checkpointing,
    for a model that never runs backward: a reference, a teacher)."""
    datasets: list[TokenizedDataset | None]
    """The training examples and the held-out ones (``None``: eval off)."""
    token_budget: int
    """Tokens of one packed row (``JobConfig.row_budget``)."""
    device: torch.device
    pad_id: int
    dtype: torch.dtype
    """The compute dtype (``parallel.param_dtype``): a frozen copy is held in it."""
    facts: tuple[str, ...] = ()
    """What a pass of the model depends on besides its weights (compute dtype, attention backend, loss
    implementation): the key of anything an objective stores from one (precomputed log-probs)."""


class Objective(ABC):
    """What a run optimises (see the module docstring for the contract)."""

    name: ClassVar[str]
    """The ``objective=`` value."""
    pairs: ClassVar[bool] = False
    """What the batches must carry: preference pairs (``True``) or examples."""
    sum_names: ClassVar[tuple[str, ...]] = ()
    """The metric sums a training step keeps (``add_sums``, read once per step by ``step_sums``)."""

    def __init__(self, cfg: JobConfig, model: torch.nn.Module) -> None:
        self.cfg = cfg
        self.sums: torch.Tensor | None = None
        """The step's ``sum_names`` so far on this rank (detached)."""

    def add_sums(self, sums: torch.Tensor) -> None:
        """Add one micro-batch's ``sum_names`` (a tensor of that many values) to the step's on this rank."""
        sums = sums.detach()
        self.sums = sums if self.sums is None else self.sums + sums

    def step_sums(self, device: torch.device) -> dict[str, float]:
        """The step's ``sum_names`` over every rank (one all-reduce, every rank together); resets them."""
        local = [0.0] * len(self.sum_names) if self.sums is None else self.sums.tolist()
        self.sums = None
        return dict(zip(self.sum_names, distributed.all_reduce_sum(local, device), strict=True))

    @abstractmethod
    def describe(self) -> str:
        """The start-up log line (``objective: ...``)."""

    @abstractmethod
    def units(self, batch: Batch) -> int:
        """What ``batch`` adds to the step's denominator."""

    @abstractmethod
    def loss_sum(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The micro-batch's summed loss (fp32 scalar, differentiable); exactly 0 for a filler micro-batch."""

    def loss(self, model: torch.nn.Module, batch: Batch, counts: StepCounts) -> MicroLoss:
        """The micro-batch's summed loss and its share of the step's objective (``counts``: the step's, global)."""
        loss_sum = self.loss_sum(model, batch)
        # An all-masked micro-batch gives loss_sum == 0 (a sum over no unit), so zero gradient, never NaN.
        return MicroLoss(loss_sum, loss_sum / max(counts.units, 1.0))

    def step_metrics(self, loss_sum: float, counts: StepCounts, device: torch.device) -> dict[str, Any]:
        """The step record's ``loss`` (``loss_sum``: the global summed loss) and the objective's own fields."""
        return {"loss": loss_sum / max(counts.units, 1.0)}

    @abstractmethod
    def evaluate(
        self,
        model: torch.nn.Module,
        dataset: TokenizedDataset,
        token_budget: int,
        device: torch.device,
        pad_id: int,
        route: Any,
    ) -> dict[str, Any]:
        """The held-out loss (``eval_loss``, ``eval_tokens``, ``eval_time_s``, and the objective's own)."""

    @abstractmethod
    def check_loss(self) -> Any:
        """The startup self-check's loss of the check (``trainer.model.certification.TokenLossCheck``'s interface)."""

    def check_indices(self, indices: np.ndarray, lengths: np.ndarray, budget: int) -> np.ndarray:
        """The self-check's batch from ``worst_case_microbatch``'s indices (as they are, by default)."""
        return indices

    def setup(self, model: torch.nn.Module, run: RunSetup) -> torch.nn.Module:
        """Shard the policy and build what the objective holds beside it; returns the sharded policy."""
        return run.shard(model)
