"""``objective=dpo``: DPO and its variants over packed preference pairs.

    data (``trainer.data.pairs``: a pair is one example, two sequences)
      -> collate (each sequence its own varlen segment; ``Batch.num_pairs``)
      -> ``sequence_logps``            summed reply log-probs per sequence, through the chunked fused head
                                       (``VarlenCausalLM.sequence_logps``)
      -> ``trainer.objectives.reference``  the reference's log-probs: ``live`` (a frozen FSDP2 copy, or the LoRA
                                       base with the adapters off) or ``precompute`` (stored in the cache)
      -> ``pair_losses``               sigmoid / robust / ipo / simpo per pair, and the rewards
      -> ``DPO``                       the objective: the summed pair loss of a micro-batch over the GLOBAL pair
                                       count, the TRL-named metrics, eval, the self-check's ``PairLossCheck``.

Per pair, from the summed reply log-probs of the policy (``pi``) and the reference (``ref``), TRL's formulas:

- ``sigmoid`` (DPO): ``h = beta * ((pi_c - ref_c) - (pi_r - ref_r))``,
  ``loss = -(1 - eps) log sigmoid(h) - eps log sigmoid(-h)`` (``eps``: ``dpo.label_smoothing``, cDPO);
- ``robust`` (robust DPO): ``loss = (-(1 - eps) log sigmoid(h) + eps log sigmoid(-h)) / (1 - 2 eps)``;
- ``ipo``: on mean token log-probs, ``loss = (h / beta - 1 / (2 beta))^2``;
- ``simpo`` (reference-free): ``loss = -log sigmoid(beta * (mean pi_c - mean pi_r) - gamma)``.

Rewards (detached): ``beta * (pi - ref)`` of each reply (``simpo``: ``beta * mean pi``). The step's loss is the
sum of pair losses over every micro-batch and rank divided by the GLOBAL pair count (``units``, all-reduced with
the step's counts before the backward passes), so packed, padded and every world size optimise the same
objective, as the SFT loss is divided by the global label count.

**The self-check's loss** (``PairLossCheck``). The startup self-check's loss under ``objective=dpo``
(``trainer.model.certification``'s loss of the check).

The packed side is the run's own DPO path: ``sequence_logps`` (the per-sequence summed reply log-probs
through the chunked head) -> ``PairLoss.from_logps`` (the pair losses of the run's ``dpo``
config). The side alone makes the same pair losses from each sequence run alone (full logits, the summed
log-probs of its reply tokens). Both divide by the batch's pair count, as a step divides by the global one.

The reference log-probs of the check are each side's own log-probs, detached: the margin is then exactly 0
on both sides, where the sigmoid's slope (hence the gradient the check compares) is largest, and the
gradient compared is the policy's alone, weighed alike on both sides. Constants shared by the two sides
(the packed log-probs for both) would carry the fp32 rounding of the summed log-probs into the sigmoid's
weight: on a 6-pair, 1,605-token batch of ``cpu_dpo``'s pairs the sums differ by 1.2e-3, which moved the
fp32 gradient by 7.9e-5 against the 1e-4 tolerance (own constants: 4.2e-7; ``docs/dpo.md``); the log-probs
are compared apart, at their own tolerance.
``simpo`` has no reference. The reference a run trains with (a frozen copy, the LoRA base, stored
log-probs) is a no-grad pass through the same forward, so its exactness is the policy's: what this checks.

Pair losses are separable, so the side alone runs one pair at a time (``group = 2``: memory of one pair).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainer.collate import Batch
from trainer.config import DPOConfig
from trainer.data.examples import IGNORE_INDEX, TokenizedDataset
from trainer.evaluate import eval_sums
from trainer.loss import sequence_of_labels
from trainer.objectives.base import Objective, RunSetup
from trainer.objectives.reference import plan_reference, sequence_logps
from trainer.router_aux import use_router_aux
from trainer.throughput import StepCounts

log = logging.getLogger("trainer")


def sequence_label_counts(batch: Batch) -> torch.Tensor:
    """Label (reply) tokens per sequence, ``[sequences]`` (the length SimPO and IPO normalise by)."""
    sequences = batch.labels.shape[0] if batch.cu_seqlens is None else len(batch.cu_seqlens) - 1
    return torch.bincount(sequence_of_labels(batch.labels, batch.cu_seqlens), minlength=sequences)


PAIR_SUMS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected")
"""What a micro-batch sums over its pairs (``PairLoss.loss_sum``); divided by the pair count, the
metrics with TRL's names (``preference_metrics`` adds ``rewards/margins``)."""


def pair_losses(
    policy_c: torch.Tensor,
    policy_r: torch.Tensor,
    ref_c: torch.Tensor | None,
    ref_r: torch.Tensor | None,
    cfg: DPOConfig,
    len_c: torch.Tensor | None = None,
    len_r: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair ``[P]``: the loss, the chosen reward and the rejected reward (rewards detached). ``len_*``:
    reply tokens per sequence (``ipo`` and ``simpo`` average the log-probs over them)."""
    beta = cfg.beta
    if cfg.loss == "simpo":
        chosen, rejected = beta * policy_c / len_c, beta * policy_r / len_r
        return -F.logsigmoid(chosen - rejected - cfg.simpo_gamma), chosen.detach(), rejected.detach()
    if cfg.loss == "ipo":
        policy_c, policy_r, ref_c, ref_r = policy_c / len_c, policy_r / len_r, ref_c / len_c, ref_r / len_r
    chosen, rejected = beta * (policy_c - ref_c), beta * (policy_r - ref_r)
    if cfg.loss == "ipo":
        losses = ((chosen - rejected) / beta - 1.0 / (2.0 * beta)) ** 2
    else:
        h, eps = chosen - rejected, cfg.label_smoothing
        if cfg.loss == "robust":
            losses = (-F.logsigmoid(h) * (1.0 - eps) + F.logsigmoid(-h) * eps) / (1.0 - 2.0 * eps)
        else:
            losses = -F.logsigmoid(h) * (1.0 - eps) - F.logsigmoid(-h) * eps
    return losses, chosen.detach(), rejected.detach()


def preference_metrics(sums: list[float], pairs: float, prefix: str = "") -> dict[str, float]:
    """TRL-named means over ``pairs`` from ``PAIR_SUMS``-ordered sums (all ranks)."""
    out = {prefix + name: value / max(pairs, 1.0) for name, value in zip(PAIR_SUMS, sums, strict=True)}
    out[prefix + "rewards/margins"] = out[prefix + "rewards/chosen"] - out[prefix + "rewards/rejected"]
    return out


class PairLoss:
    """A micro-batch's summed pair loss and its metric sums, from the policy and its reference (DPO's core)."""

    def __init__(self, cfg: DPOConfig, reference) -> None:
        self.cfg = cfg
        self.reference = reference
        """``trainer.objectives.reference``'s ``LiveReference`` (a frozen copy, or the LoRA base) or
        ``PrecomputedReference`` (``None``: ``simpo``)."""

    def describe(self) -> str:
        ref = "none (reference-free)" if self.reference is None else self.reference.describe()
        return (
            f"dpo loss={self.cfg.loss} beta={self.cfg.beta} label_smoothing={self.cfg.label_smoothing} reference={ref}"
        )

    def loss_sum(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed pair loss, fp32 scalar with grad; ``PAIR_SUMS`` of the batch, float64, detached). A
        filler batch (no pair) still runs both models (their collectives line up) and gives exactly 0."""
        ref = None if self.reference is None else self.reference.logps(batch)
        return self.from_logps(sequence_logps(model, batch), ref, batch)

    def from_logps(
        self, logps: torch.Tensor, ref: torch.Tensor | None, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = batch.num_pairs
        if n == 0:
            return logps.sum() * 0.0, torch.zeros(len(PAIR_SUMS), dtype=torch.float64, device=logps.device)
        lengths = sequence_label_counts(batch)[: 2 * n].to(logps.dtype)
        ref_c = ref_r = None
        if ref is not None:
            ref = ref[: 2 * n].to(logps.dtype)
            ref_c, ref_r = ref[0::2], ref[1::2]
        policy_c, policy_r = logps[0 : 2 * n : 2], logps[1 : 2 * n : 2]
        losses, chosen, rejected = pair_losses(policy_c, policy_r, ref_c, ref_r, self.cfg, lengths[0::2], lengths[1::2])
        sums = (
            torch.stack(
                [
                    losses.sum(),
                    chosen.sum(),
                    rejected.sum(),
                    (chosen > rejected).float().sum(),
                    policy_c.sum(),
                    policy_r.sum(),
                ]
            )
            .detach()
            .double()
        )
        return losses.sum(), sums


class DPO(Objective):
    """``objective=dpo``: the summed pair loss over the global pair count, the TRL-named metrics."""

    name = "dpo"
    pairs = True
    sum_names = PAIR_SUMS

    def __init__(self, cfg, model: torch.nn.Module) -> None:
        super().__init__(cfg, model)
        use_router_aux(model, cfg.parallel.cp, self.name)  # refused: the router aux loss is SFT's term
        self.pair_loss = PairLoss(cfg.dpo, reference=None)
        """The pair losses and the reference (``setup`` builds the reference)."""

    @property
    def reference(self):
        return self.pair_loss.reference

    def describe(self) -> str:
        return self.pair_loss.describe()

    def setup(self, model: torch.nn.Module, run: RunSetup) -> torch.nn.Module:
        """The reference: planned from the unsharded starting policy (a frozen copy, or its fingerprint), built
        after the policy is sharded (a live copy is sharded the same way, ``precompute`` runs its pass now)."""
        plan = plan_reference(self.cfg.dpo, model, *run.facts, dtype=run.dtype)
        model = run.shard(model)
        self.pair_loss.reference = plan.build(
            model, lambda m: run.shard(m, frozen=True), run.datasets, run.token_budget, run.device, run.pad_id
        )
        return model

    def units(self, batch: Batch) -> int:
        return batch.num_pairs

    def loss_sum(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        loss, sums = self.pair_loss.loss_sum(model, batch)
        self.add_sums(sums)
        return loss

    def step_metrics(self, loss_sum: float, counts: StepCounts, device: torch.device) -> dict[str, Any]:
        """The mean pair loss and the step's TRL-named metrics over every rank (one all-reduce)."""
        sums = list(self.step_sums(device).values())
        return {"loss": loss_sum / max(counts.units, 1.0), "preference": preference_metrics(sums, counts.units)}

    def check_loss(self) -> PairLossCheck:
        return PairLossCheck(self.cfg.dpo)

    def check_indices(self, indices: np.ndarray, lengths: np.ndarray, budget: int) -> np.ndarray:
        """Pairs are packed whole: the pieces' pairs, as many as the budget holds (``whole_pairs``)."""
        pairs = whole_pairs(indices, lengths, budget)
        log.info(
            "startup self-check batch: %d preference pairs, their %d sequences each checked alone (logits, reply "
            "log-probs, the %s's gradient)",
            len(pairs),
            2 * len(pairs),
            self.check_loss().describe(),
        )
        return pairs

    @torch.no_grad()
    def evaluate(
        self,
        model: torch.nn.Module,
        dataset: TokenizedDataset,
        token_budget: int,
        device: torch.device,
        pad_id: int = 0,
        route=None,
    ) -> dict[str, Any]:
        """The held-out pairs, packed and dealt like SFT eval (every rank takes part): the eval loss (mean
        pair loss) and the TRL-named metrics prefixed ``eval_``."""
        start = time.perf_counter()

        def sums_of(batch: Batch) -> dict:
            pair_sums = dict(zip(PAIR_SUMS, self.pair_loss.loss_sum(model, batch)[1], strict=True))
            return pair_sums | {"pairs": batch.num_pairs, "tokens": batch.num_label_tokens}

        sums = eval_sums(model, dataset, token_budget, device, pad_id, route, sums_of)
        pairs = sums["pairs"]
        metrics = preference_metrics([sums[k] for k in PAIR_SUMS], pairs, prefix="eval_")
        return {
            "eval_loss": metrics.pop("eval_loss"),
            "eval_tokens": int(sums["tokens"]),
            "eval_time_s": time.perf_counter() - start,
            "preference": metrics | {"eval_pairs": int(pairs)},
        }


def whole_pairs(indices: np.ndarray, lengths: np.ndarray, budget: int) -> np.ndarray:
    """The self-check batch for preference pairs: the examples of its pieces (or rows), whole, in order,
    those that fit ``budget`` together (the longest pair always does)."""
    chosen, room = [], budget
    for i in dict.fromkeys(int(v) for v in (indices[:, 0] if indices.ndim == 2 else indices)):
        if lengths[i] <= room or not chosen:
            chosen.append(i)
            room -= int(lengths[i])
    return np.array(chosen, dtype=np.int64)


class PairLossCheck:
    """The self-check's loss of the check (``trainer.model.certification.TokenLossCheck``'s interface) for
    preference pairs (sequences ``2k``, ``2k + 1``)."""

    group = 2
    """A pair's two sequences: their loss comes together."""

    def __init__(self, cfg: DPOConfig) -> None:
        self.cfg = cfg
        self.pair_loss = PairLoss(cfg, reference=None)  # from_logps: the run's pair losses

    def describe(self) -> str:
        return f"dpo {self.cfg.loss} loss"

    def packed(self, model: torch.nn.Module, batch: Batch, token_losses: list[torch.Tensor] | None = None):
        """(the mean pair loss, differentiable, its reference the log-probs detached; the per-sequence summed
        reply log-probs): through the run's head, or from ``token_losses`` per sequence when a route gives logits."""
        logps = sequence_logps(model, batch) if token_losses is None else torch.stack([-t.sum() for t in token_losses])
        ref = logps.detach() if self.cfg.needs_reference else None
        loss, _ = self.pair_loss.from_logps(logps, ref, batch)
        return loss / max(1, batch.num_pairs), logps

    def alone(self, batch: Batch, token_losses: list[torch.Tensor], labels: list[torch.Tensor]) -> torch.Tensor:
        """A pair's loss from its two sequences run alone (their token losses and labels), over the batch's
        pair count, its reference its own log-probs detached (as ``packed``'s)."""
        (chosen, rejected) = (-t.sum()[None] for t in token_losses)
        len_c, len_r = ((y[1:] != IGNORE_INDEX).sum()[None].to(chosen.dtype) for y in labels)
        ref_c, ref_r = (chosen.detach(), rejected.detach()) if self.cfg.needs_reference else (None, None)
        losses, _, _ = pair_losses(chosen, rejected, ref_c, ref_r, self.cfg, len_c, len_r)
        return losses.sum() / max(1, batch.num_pairs)
