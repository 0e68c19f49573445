"""``objective=sft``: the mean token cross-entropy of the labels, over every label token of the step.

Each micro-batch's summed token loss comes from the wrapper's own path (``VarlenCausalLM.token_loss``: the
chunked fused head or the naive logits, a packed row, a padded batch or a context-parallel shard); the step
divides the sum by the GLOBAL label count (``units``), so packed, padded and any world size optimise the
same mean. Where the model's config trains a router aux loss (``trainer.router_aux``), the objective carries it
as an additive term: each micro-batch adds ``coef x`` its share of the step's load-balancing loss.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.collate import Batch
from trainer.evaluate import evaluate
from trainer.model.certification import TokenLossCheck
from trainer.objectives.base import MicroLoss, Objective
from trainer.router_aux import RouterAuxTerm, use_router_aux
from trainer.throughput import StepCounts


class SFT(Objective):
    """Supervised fine-tuning: the summed token loss over the global label count (plus the router aux term)."""

    name = "sft"

    def __init__(self, cfg, model: torch.nn.Module) -> None:
        super().__init__(cfg, model)
        aux = use_router_aux(model, cfg.parallel.cp, self.name)
        self.router = None if aux is None else RouterAuxTerm(aux)
        """The router aux loss the model's config trains (``None``: none)."""

    def describe(self) -> str:
        term = "" if self.router is None else f" + {self.router.aux.describe()}"
        return f"sft (mean token cross-entropy over the step's label tokens{term})"

    def units(self, batch: Batch) -> int:
        return batch.num_label_tokens

    def loss_sum(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return model.token_loss(**batch.model_inputs(), labels=batch.labels)

    def loss(self, model: torch.nn.Module, batch: Batch, counts: StepCounts) -> MicroLoss:
        if self.router is None:
            return super().loss(model, batch, counts)
        loss_sum, stats = model.token_loss(**batch.model_inputs(), labels=batch.labels, router=True)
        share = self.router.share(stats, batch.num_tokens, counts.tokens)
        return MicroLoss(loss_sum, loss_sum / max(counts.units, 1.0) + share)

    def step_metrics(self, loss_sum: float, counts: StepCounts, device: torch.device) -> dict[str, Any]:
        metrics = super().step_metrics(loss_sum, counts, device)
        return metrics if self.router is None else self.router.step_metrics(metrics["loss"], device)

    def evaluate(self, model, dataset, token_budget, device, pad_id, route) -> dict[str, Any]:
        return evaluate(model, dataset, token_budget, device, pad_id, route)

    def check_loss(self) -> TokenLossCheck:
        return TokenLossCheck()
