"""The objective is a component (``trainer.objectives``): the registry holds every name the config accepts, and an
objective written against the protocol alone (``base.Objective``; here a per-sequence mean through the wrapper's
``label_hidden``, chunk by chunk) trains and evaluates in a real Trainer (one gloo rank, FSDP2), its logged step-1
loss the same objective computed on the unsharded starting model."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import compose_job
from tests.faults.conftest import SMALL_RUN, one_rank_world
from trainer.collate import Batch
from trainer.config import OBJECTIVES
from trainer.data.examples import IGNORE_INDEX
from trainer.evaluate import eval_batches
from trainer.loss import LabelHidden, sequence_of_labels
from trainer.model.certification import TokenLossCheck
from trainer.objectives import OBJECTIVE_TYPES, Objective


def test_the_registry_holds_every_objective_the_config_accepts():
    assert set(OBJECTIVE_TYPES) == set(OBJECTIVES)
    assert all(cls.name == name for name, cls in OBJECTIVE_TYPES.items())


class MeanSequenceLoss(Objective):
    """Each sequence's mean token cross-entropy, averaged over the step's sequences (those with a label)."""

    name = "mean_sequence"

    def describe(self) -> str:
        return "mean over sequences of their mean token loss"

    def units(self, batch: Batch) -> int:
        return len(set(sequence_ids(batch).tolist()))

    def loss_sum(self, model, batch: Batch) -> torch.Tensor:
        ids = sequence_ids(batch)
        return model.label_hidden(
            **batch.model_inputs(), labels=batch.labels, fn=lambda head: per_sequence_mean(head, ids)
        )

    @torch.no_grad()
    def evaluate(self, model, dataset, token_budget, device, pad_id, route) -> dict:
        loss = units = tokens = 0.0
        for batch in eval_batches(dataset, token_budget, device, pad_id, route):
            loss, units, tokens = (
                loss + float(self.loss_sum(model, batch)),
                units + self.units(batch),
                tokens + batch.num_label_tokens,
            )
        return {"eval_loss": loss / max(units, 1.0), "eval_tokens": int(tokens), "eval_time_s": 0.0}

    def check_loss(self) -> TokenLossCheck:
        return TokenLossCheck()


def sequence_ids(batch: Batch) -> torch.Tensor:
    return sequence_of_labels(batch.labels, batch.cu_seqlens)


def per_sequence_mean(head: LabelHidden, ids: torch.Tensor) -> torch.Tensor:
    """Summed over sequences: each one's mean token loss, the logits made ``chunk_tokens`` rows at a time."""
    losses = []
    for start in range(0, len(head.targets), head.chunk_tokens):
        logits = head.logits(start, start + head.chunk_tokens)
        losses.append(
            torch.nn.functional.cross_entropy(logits, head.targets[start : start + head.chunk_tokens], reduction="none")
        )
    token_losses = torch.cat(losses) if losses else head.hidden.sum(-1) * 0.0
    sequences = int(ids.max()) + 1 if len(ids) else 1
    sums = torch.zeros(sequences, device=token_losses.device).index_add(0, ids, token_losses)
    counts = torch.bincount(ids, minlength=sequences).clamp_min(1)
    return (sums / counts).sum()


def test_an_objective_written_against_the_protocol_trains_in_the_trainer(tmp_path, monkeypatch):
    from trainer.config import job
    from trainer.loop import Trainer
    from trainer.model import build_model

    monkeypatch.setitem(OBJECTIVE_TYPES, MeanSequenceLoss.name, MeanSequenceLoss)
    monkeypatch.setattr(job, "OBJECTIVES", (*OBJECTIVES, MeanSequenceLoss.name))
    cfg = compose_job(
        [
            *SMALL_RUN,
            "max_steps=2",
            "grad_accum=2",
            "eval.every=2",
            "parallel.param_dtype=float32",
            "objective=mean_sequence",
            f"run_dir={tmp_path}",
        ]
    )
    with one_rank_world():
        trainer = Trainer(cfg)
        batches = [trainer.next_step_batches()]
        trainer.next_step_batches = lambda: batches[0]
        reference = build_model(cfg.model, trainer.tokenizer, trainer.backend, cfg.seed)
        reference.use_loss(cfg.loss.impl, cfg.loss.chunk_tokens)
        objective = MeanSequenceLoss(cfg, reference)
        with torch.no_grad():
            expected = sum(float(objective.loss_sum(reference, b)) for b in batches[0]) / sum(
                objective.units(b) for b in batches[0]
            )
        metrics = trainer.train_step()
        evaluated = trainer.evaluate()
        trainer.metrics.close()
    assert all((b.labels != IGNORE_INDEX).any() for b in batches[0])
    # certified through the objective's loss of the check, every stage in one certificate (summary.json's)
    assert [(s.name, s.outcome) for s in trainer.certificate.stages] == [
        ("table prior", "exact"),
        ("replica", "exact"),
        ("self-check", "exact"),
    ]
    assert metrics.loss == pytest.approx(expected, rel=1e-5)
    assert evaluated.eval_loss > 0 and evaluated.eval_tokens > 0
