"""The faults the tests inject (``tests.faults.inject``): each acts at its step, on its rank, and only there, by
wrapping the Trainer's phases (the library's step has no hook)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.faults.inject import Faults, FaultyTrainer
from trainer.collate import Batch
from trainer.data.examples import IGNORE_INDEX
from trainer.objectives import MicroLoss


def _batch() -> Batch:
    return Batch(
        input_ids=torch.ones(1, 4, dtype=torch.long),
        labels=torch.ones(1, 4, dtype=torch.long),
        position_ids=torch.arange(4)[None],
        num_label_tokens=3,
    )


class _Objective:
    def loss(self, model, batch, counts) -> MicroLoss:
        loss = model(torch.ones(1, 2)).sum()
        return MicroLoss(loss, loss)


def _stand_in(faults: Faults) -> FaultyTrainer:
    """A FaultyTrainer's phases around stand-ins for what the Trainer builds (no setup run)."""
    trainer = FaultyTrainer.__new__(FaultyTrainer)
    trainer.faults, trainer.step = faults, 0
    trainer.model, trainer.objective = torch.nn.Linear(2, 2), _Objective()
    trainer.sampler = None
    return trainer


def test_each_fault_acts_only_at_its_step_and_rank(monkeypatch):
    trainer = _stand_in(Faults("no_labels@2,nan_loss@3:1,oom@3:0,nan_grad@4", rank=0))
    monkeypatch.setattr("trainer.loop.Trainer.next_step_batches", lambda self: [_batch()])
    for step in (1, 2, 3, 4):
        trainer.faults.start_step(step)
        (batch,) = trainer.next_step_batches()
        assert (batch.num_label_tokens == 0) == (step == 2)
        assert bool((batch.labels == IGNORE_INDEX).all()) == (step == 2)
        trainer.model.zero_grad()
        if step == 3:  # oom is rank 0's; nan_loss is rank 1's
            with pytest.raises(torch.OutOfMemoryError, match="injected"):
                trainer.forward_backward(batch, None)
            continue
        assert math.isfinite(trainer.forward_backward(batch, None).item())
        assert torch.isfinite(trainer.model.weight.grad).all() == (step != 4)
    rank1 = _stand_in(Faults("nan_loss@3:1", rank=1))
    rank1.faults.start_step(3)
    assert math.isnan(rank1.forward_backward(_batch(), None).item())
    assert torch.isnan(rank1.model.weight.grad).all()
    assert "loss" not in vars(rank1.objective)  # the objective is itself again after the micro-batch


def test_no_faults_no_effect():
    assert not Faults(None, rank=0).faults
    assert Faults("nan_loss@1:1", rank=1).faults and not Faults("nan_loss@1:1", rank=0).faults
