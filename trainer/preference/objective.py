"""The preference losses and the objective the training loop calls.

Per pair, from the summed reply log-probs of the policy (``pi``) and the reference (``ref``), TRL's formulas:

- ``sigmoid`` (DPO): ``h = beta * ((pi_c - ref_c) - (pi_r - ref_r))``,
  ``loss = -(1 - eps) log sigmoid(h) - eps log sigmoid(-h)`` (``eps``: ``dpo.label_smoothing``, cDPO);
- ``robust`` (robust DPO): ``loss = (-(1 - eps) log sigmoid(h) + eps log sigmoid(-h)) / (1 - 2 eps)``;
- ``ipo``: on mean token log-probs, ``loss = (h / beta - 1 / (2 beta))^2``;
- ``simpo`` (reference-free): ``loss = -log sigmoid(beta * (mean pi_c - mean pi_r) - gamma)``.

Rewards (detached): ``beta * (pi - ref)`` of each reply (``simpo``: ``beta * mean pi``). The step's loss is the
sum of pair losses over every micro-batch and rank divided by the GLOBAL pair count (the loop all-reduces
it before the backward passes), so packed, padded and every world size optimise the same objective, as the
SFT loss is divided by the global label count.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from trainer import distributed
from trainer.collate import Batch, collate_packed
from trainer.config import DPOConfig
from trainer.data.examples import TokenizedDataset
from trainer.preference.logps import sequence_label_counts, sequence_logps

PAIR_SUMS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected")
"""What a micro-batch sums over its pairs (``PreferenceObjective.loss_sum``); divided by the pair count, the
metrics with TRL's names (``preference_metrics`` adds ``rewards/margins``)."""


def pair_losses(
    policy_c: torch.Tensor, policy_r: torch.Tensor, ref_c: torch.Tensor | None, ref_r: torch.Tensor | None,
    cfg: DPOConfig, len_c: torch.Tensor | None = None, len_r: torch.Tensor | None = None,
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
    out = {prefix + name: value / max(pairs, 1.0) for name, value in zip(PAIR_SUMS, sums)}
    out[prefix + "rewards/margins"] = out[prefix + "rewards/chosen"] - out[prefix + "rewards/rejected"]
    return out


class PreferenceObjective:
    """What the loop calls for ``objective=dpo``: a micro-batch's summed pair loss and its metric sums."""

    def __init__(self, cfg: DPOConfig, reference) -> None:
        self.cfg = cfg
        self.reference = reference
        """``trainer.preference.reference``'s ``LiveReference`` (a frozen copy, or the LoRA base) or
        ``PrecomputedReference`` (``None``: ``simpo``)."""

    def describe(self) -> str:
        ref = "none (reference-free)" if self.reference is None else self.reference.describe()
        return f"dpo loss={self.cfg.loss} beta={self.cfg.beta} label_smoothing={self.cfg.label_smoothing} reference={ref}"

    def loss_sum(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed pair loss, fp32 scalar with grad; ``PAIR_SUMS`` of the batch, float64, detached). A
        filler batch (no pair) still runs both models (their collectives line up) and gives exactly 0."""
        ref = None if self.reference is None else self.reference.logps(batch)
        return self.from_logps(sequence_logps(model, batch), ref, batch)

    def from_logps(self, logps: torch.Tensor, ref: torch.Tensor | None, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
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
        sums = torch.stack([losses.sum(), chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(),
                            policy_c.sum(), policy_r.sum()]).detach().double()
        return losses.sum(), sums

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, dataset: TokenizedDataset, token_budget: int, device: torch.device,
                 pad_id: int = 0) -> dict[str, float]:
        """The held-out pairs, packed and dealt like SFT eval (every rank takes part): the eval loss (mean
        pair loss) and the TRL-named metrics prefixed ``eval_``."""
        from trainer.evaluate import eval_microbatches

        start = time.perf_counter()
        was_training = model.training
        model.eval()
        sums = torch.zeros(len(PAIR_SUMS), dtype=torch.float64, device=device)
        pairs = tokens = 0
        for indices in eval_microbatches(dataset.lengths, token_budget, distributed.rank(), distributed.world_size()):
            batch = collate_packed(dataset, indices, pad_id).to(device)
            sums += self.loss_sum(model, batch)[1]
            pairs, tokens = pairs + batch.num_pairs, tokens + batch.num_label_tokens
        model.train(was_training)
        *sums, pairs, tokens = distributed.all_reduce_sum([*sums.tolist(), pairs, tokens], device)
        metrics = preference_metrics(sums, pairs, prefix="eval_")
        return {"eval_loss": metrics.pop("eval_loss"), "eval_tokens": int(tokens),
                "eval_time_s": time.perf_counter() - start, "preference": metrics | {"eval_pairs": int(pairs)}}
