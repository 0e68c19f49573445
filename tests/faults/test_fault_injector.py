"""The fault-injection hooks the train loop calls: each fault acts at its step, on its rank, and only there."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.collate import IGNORE_INDEX, Batch
from trainer.guard import FaultInjector


def _batch() -> Batch:
    return Batch(input_ids=torch.ones(1, 4, dtype=torch.long), labels=torch.ones(1, 4, dtype=torch.long),
                 position_ids=torch.arange(4)[None], num_label_tokens=3)


def test_hooks_act_only_at_their_step_and_rank():
    faults = FaultInjector("no_labels@2,nan_loss@3:1,oom@3:0,nan_grad@4", rank=0)
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    for step in (1, 2, 3, 4):
        faults.before_step(step)
        batch = _batch()
        faults.on_batch(batch)
        assert (batch.num_label_tokens == 0) == (step == 2)
        assert bool((batch.labels == IGNORE_INDEX).all()) == (step == 2)
        if step == 3:  # oom is rank 0's; nan_loss is rank 1's
            with pytest.raises(torch.OutOfMemoryError, match="injected"):
                faults.before_forward()
        else:
            faults.before_forward()
        assert math.isfinite(faults.on_loss(torch.tensor(2.0)).item())
        faults.after_backward(model)
        assert torch.isfinite(model.weight.grad).all() == (step != 4)
    rank1 = FaultInjector("nan_loss@3:1", rank=1)
    rank1.before_step(3)
    assert math.isnan(rank1.on_loss(torch.tensor(2.0)).item())


def test_no_faults_no_effect():
    faults = FaultInjector(None, rank=0)
    faults.before_step(1)
    batch = _batch()
    faults.on_batch(batch)
    faults.before_forward()
    loss = torch.tensor(2.0)
    assert faults.on_loss(loss) is loss and batch.num_label_tokens == 3
    assert FaultInjector("nan_loss@1:1", rank=1).faults and not FaultInjector("nan_loss@1:1", rank=0).faults
