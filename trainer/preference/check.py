"""The startup self-check's loss under ``objective=dpo`` (``trainer.model.selfcheck``'s loss of the check).

The packed side is the run's own DPO path: ``sequence_logps`` (the per-sequence summed reply log-probs
through the chunked head) -> ``PreferenceObjective.from_logps`` (the pair losses of the run's ``dpo``
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

import torch

from trainer.collate import IGNORE_INDEX, Batch
from trainer.config import DPOConfig
from trainer.preference.logps import sequence_logps
from trainer.preference.objective import PreferenceObjective, pair_losses


class PairLossCheck:
    """``CheckLoss`` of ``trainer.model.selfcheck`` for preference pairs (sequences ``2k``, ``2k + 1``)."""

    group = 2
    """A pair's two sequences: their loss comes together."""

    def __init__(self, cfg: DPOConfig) -> None:
        self.cfg = cfg
        self.objective = PreferenceObjective(cfg, reference=None)  # from_logps: the run's pair losses

    def describe(self) -> str:
        return f"dpo {self.cfg.loss} loss"

    def packed(self, model: torch.nn.Module, batch: Batch, token_losses: list[torch.Tensor] | None = None):
        """(the mean pair loss, differentiable, its reference the log-probs detached; the per-sequence summed
        reply log-probs): through the run's head, or from ``token_losses`` per sequence when a route gives logits."""
        logps = sequence_logps(model, batch) if token_losses is None else torch.stack([-t.sum() for t in token_losses])
        ref = logps.detach() if self.cfg.needs_reference else None
        loss, _ = self.objective.from_logps(logps, ref, batch)
        return loss / max(1, batch.num_pairs), logps

    def alone(self, batch: Batch, token_losses: list[torch.Tensor], labels: list[torch.Tensor]) -> torch.Tensor:
        """A pair's loss from its two sequences run alone (their token losses and labels), over the batch's
        pair count, its reference its own log-probs detached (as ``packed``'s)."""
        (chosen, rejected) = (-t.sum()[None] for t in token_losses)
        len_c, len_r = ((y[1:] != IGNORE_INDEX).sum()[None].to(chosen.dtype) for y in labels)
        ref_c, ref_r = (chosen.detach(), rejected.detach()) if self.cfg.needs_reference else (None, None)
        losses, _, _ = pair_losses(chosen, rejected, ref_c, ref_r, self.cfg, len_c, len_r)
        return losses.sum() / max(1, batch.num_pairs)
