"""``objective=distill``: the ``Objective`` (``trainer.objectives.base``) of knowledge distillation.

    data (any SFT data: the labels are the reply tokens)
      -> collate (packed rows, split pieces or padded rows, as for SFT)
      -> the teacher's rows of the batch:   ``live``: its label positions' hidden states and its head, from
                                             its own pass over the same batch (``VarlenCausalLM.label_hidden``;
                                             FSDP2 keeps its root gathered until the student's loss is done)
                                             ``precompute``: the stored top-k (``topk.TopKStore``)
      -> the student's distillation loss:    ``loss.chunked_distill_loss`` inside its own forward window
                                             (``label_hidden``), or ``loss.naive_distill_loss`` from its logits
                                             (``loss.impl=naive``, or a head the chunk cannot reproduce)
      -> ``Distill.loss_sum``                the summed per-token loss; the step divides by the GLOBAL label count.

The step's record keeps the loss trained and, under ``distill``, its parts: the mean token cross-entropy (the
SFT loss of the same tokens) and the mean divergence.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from trainer import distributed
from trainer.collate import Batch, collate_packed
from trainer.config import JobConfig
from trainer.data import load_tokenizer
from trainer.data.examples import TokenizedDataset
from trainer.evaluate import eval_microbatches, eval_sums
from trainer.objectives.base import Objective, RunSetup
from trainer.objectives.distill.check import DistillLossCheck
from trainer.objectives.distill.loss import TERMS, student_terms
from trainer.objectives.distill.teacher import live_teacher, load_teacher, teacher_top_k
from trainer.objectives.distill.topk import TopKStore, precompute_top_k
from trainer.objectives.reference import reference_fingerprint, reshard
from trainer.router_aux import use_router_aux
from trainer.throughput import StepCounts

log = logging.getLogger("trainer")


def local_bytes(param: torch.Tensor) -> int:
    """The bytes of ``param`` this rank holds (its shard, for an FSDP2 ``DTensor``)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.numel() * local.element_size()


class Distill(Objective):
    """Knowledge distillation from a frozen teacher (``distill`` section, ``trainer.config.distill``)."""

    name = "distill"
    sum_names = TERMS

    def __init__(self, cfg: JobConfig, model: torch.nn.Module) -> None:
        super().__init__(cfg, model)
        use_router_aux(model, cfg.parallel.cp, self.name)  # refused: the router aux loss is SFT's term
        self.distill = cfg.distill
        device = next(model.parameters()).device
        self.teacher: torch.nn.Module | None = load_teacher(cfg, load_tokenizer(cfg.model, cfg.data), model, device)
        """Unsharded in the master dtype until ``setup``; then sharded (``live``) or dropped (``precompute``)."""
        self.k = min(self.distill.top_k, model.model.get_output_embeddings().weight.shape[0])
        self.store: TopKStore | None = None
        self.train_dataset: TokenizedDataset | None = None
        """The examples ``loss_sum``'s batches come from (``precompute`` finds their rows by example)."""
        self.held = ""
        """``live``: what the teacher holds per rank, for the start-up line."""

    def describe(self) -> str:
        d = self.distill
        beta = f" beta={d.beta}" if d.divergence == "jsd" else ""
        source = (
            f"precompute (the teacher's top-{self.k} per label token, {self.store.folder})"
            if self.store
            else f"live ({self.held})"
        )
        return (
            f"distill {d.divergence}{beta} temperature={d.temperature} alpha={d.alpha} (x cross-entropy) from "
            f"teacher {d.teacher}: {source}"
        )

    def units(self, batch: Batch) -> int:
        return batch.num_label_tokens

    def setup(self, model: torch.nn.Module, run: RunSetup) -> torch.nn.Module:
        """The student sharded; the teacher cast to the compute dtype and sharded like a frozen reference, kept
        (``live``) or run once over the data and dropped (``precompute``)."""
        model = run.shard(model)
        teacher, self.teacher = self.teacher, None
        self.train_dataset = run.datasets[0]
        key = ""
        if self.distill.teacher_logits == "precompute":  # of the weights as loaded, before the cast
            key = reference_fingerprint(
                teacher, str(run.dtype), teacher.backend.name, f"T={self.distill.temperature}", f"k={self.k}"
            )
        for p in teacher.parameters():  # in place: one teacher in memory (buffers keep their dtype, as RoPE's)
            p.data = p.data.to(run.dtype)
        teacher = run.shard(teacher, frozen=True)
        teacher.set_reshard_after_forward(False, recurse=False)  # its head stays gathered for the student's loss
        if self.distill.teacher_logits == "live":
            self.teacher = teacher
            held = sum(local_bytes(p) for p in teacher.parameters()) / 2**20
            self.held = f"FSDP2-sharded, frozen, in {str(run.dtype).removeprefix('torch.')}: {held:.1f} MiB per rank"
        else:
            self.store = self.precompute(teacher, key, run)
        return model

    def precompute(self, teacher: torch.nn.Module, key: str, run: RunSetup) -> TopKStore:
        """The store of the teacher's top-k (``topk.precompute_top_k``): read, or made by one pass of ``teacher``
        (as sharded for training) over this rank's eval-dealt micro-batches of every example."""

        def batches(lengths):
            return eval_microbatches(lengths, run.token_budget, distributed.rank(), distributed.world_size())

        def rows(batch):
            out = teacher_top_k(teacher, batch, self.distill.temperature, self.k)
            reshard(teacher)
            return out

        vocab = teacher.model.get_output_embeddings().weight.shape[0]
        return precompute_top_k(
            rows, run.datasets[0], key, self.k, vocab, batches, collate_packed, run.device, run.pad_id
        )

    def terms(self, model: torch.nn.Module, batch: Batch, dataset: TokenizedDataset | None) -> torch.Tensor:
        """``TERMS`` of one micro-batch of ``dataset`` through the student and the teacher's rows."""
        if self.store is not None:
            rows = self.store.teacher(dataset, batch.to("cpu"), batch.input_ids.device)
            return student_terms(model, batch, rows, self.distill)
        try:
            rows = live_teacher(self.teacher, batch, self.distill.temperature)
            return student_terms(model, batch, rows, self.distill)
        finally:
            reshard(self.teacher)  # its root (head) was kept gathered through the student's loss

    def loss_sum(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        terms = self.terms(model, batch, self.train_dataset)
        self.add_sums(terms)
        return terms[0]

    def step_metrics(self, loss_sum: float, counts: StepCounts, device: torch.device) -> dict[str, Any]:
        """The mean distillation loss and its parts over every rank (one all-reduce)."""
        sums = self.step_sums(device)
        units = max(counts.units, 1.0)
        return {"loss": loss_sum / units, "distill": {k: sums[k] / units for k in TERMS[1:]}}

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
        """The held-out examples, packed and dealt like SFT eval: the mean distillation loss, and its parts."""
        start = time.perf_counter()

        def sums_of(batch: Batch) -> dict:
            terms = dict(zip(TERMS, self.terms(model, batch, dataset), strict=True))
            return terms | {"tokens": batch.num_label_tokens}

        sums = eval_sums(model, dataset, token_budget, device, pad_id, route, sums_of)
        n = max(sums["tokens"], 1.0)
        return {
            "eval_loss": sums[TERMS[0]] / n,
            "eval_tokens": int(sums["tokens"]),
            "eval_time_s": time.perf_counter() - start,
            "distill": {f"eval_{k}": sums[k] / n for k in TERMS[1:]},
        }

    def check_loss(self) -> DistillLossCheck:
        stored = self.distill.teacher_logits == "precompute"
        return DistillLossCheck(self.teacher, self.distill, self.k if stored else None)
