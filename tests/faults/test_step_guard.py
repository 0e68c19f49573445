"""Items 1 and 2 in one process: all-masked micro-batches, steps with no label, NaN/Inf skip or stop.

A step that is skipped must leave parameters *and* optimizer state (AdamW moments and step counters)
bit-identical, whatever the clipping setting; the next good step must train normally.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.faults.inject import Faults, inject, parse_faults
from trainer.data.examples import IGNORE_INDEX
from trainer.guard import TrainingHalted
from trainer.throughput import StepCounts


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def snapshot(trainer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params = [_local(p) for p in trainer.model.parameters()]
    state = [_local(v) for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return params, state


def assert_same(a, b) -> None:
    for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True):
        assert torch.equal(x, y)


def test_all_masked_microbatch_has_zero_loss_and_zero_gradient(trainer):
    _, indices, _ = trainer.sampler.next_microbatch()
    batch = trainer.collate(trainer.dataset, indices, trainer.tokenizer.pad_token_id)
    batch.labels.fill_(IGNORE_INDEX)
    batch.num_label_tokens = 0
    loss = trainer.forward_backward(batch, StepCounts.of([batch], trainer.objective.units))
    assert loss.item() == 0.0
    grads = [_local(p.grad) for p in trainer.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and not g.any() for g in grads)
    trainer.optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_step_without_labels_is_skipped_and_changes_nothing(trainer, grad_clip):
    trainer.cfg.optim.grad_clip = grad_clip
    trainer.train_step()  # the optimizer has state before the skipped step
    inject(trainer, "no_labels@NEXT")
    before, skipped_before = snapshot(trainer), trainer.guard.skipped["no_labels"]
    metrics = trainer.train_step()
    assert metrics.skipped == "no_labels" and metrics.loss == 0.0 and metrics.grad_norm == 0.0
    assert metrics.useful_tokens == 0
    assert trainer.guard.skipped["no_labels"] == skipped_before + 1
    assert_same(before, snapshot(trainer))
    trainer.cfg.optim.grad_clip = 1.0


@pytest.mark.parametrize("fault", ["nan_loss", "nan_grad"])
def test_nonfinite_step_is_skipped_then_training_goes_on(trainer, fault):
    trainer.guard.cfg.nonfinite = "skip"
    trainer.train_step()
    inject(trainer, f"{fault}@NEXT")
    before = snapshot(trainer)
    metrics = trainer.train_step()
    assert metrics.skipped == "nonfinite" and math.isnan(metrics.grad_norm)
    assert_same(before, snapshot(trainer))
    after_skip = snapshot(trainer)
    metrics = trainer.train_step()  # no fault due: a normal step, the update applies
    assert metrics.skipped is None and math.isfinite(metrics.loss)
    assert not torch.equal(after_skip[0][0], snapshot(trainer)[0][0])


def test_nonfinite_step_stops_the_run_naming_the_step(trainer):
    trainer.guard.cfg.nonfinite = "stop"
    inject(trainer, "nan_loss@NEXT")
    step = trainer.step + 1
    before = snapshot(trainer)
    with pytest.raises(TrainingHalted, match=rf"^step {step}: rank 0: loss and gradient norm not finite"):
        trainer.train_step()
    assert_same(before, snapshot(trainer))
    trainer.guard.cfg.nonfinite = "skip"
    trainer.optimizer.zero_grad(set_to_none=True)


def test_too_many_nonfinite_steps_in_a_row_stop(trainer):
    trainer.guard.cfg.max_consecutive_skips = 2
    trainer.guard.consecutive_nonfinite = 0
    first = trainer.step + 1
    trainer.faults = Faults(f"nan_loss@{first},nan_loss@{first + 1}", rank=0)
    trainer.train_step()
    with pytest.raises(TrainingHalted, match=rf"step {first + 1}: .*2 non-finite steps in a row"):
        trainer.train_step()
    trainer.guard.cfg.max_consecutive_skips = 5
    trainer.optimizer.zero_grad(set_to_none=True)


def test_fault_specs_are_checked():
    assert [(f.kind, f.step, f.rank) for f in parse_faults("oom@3:1, hang@2")] == [("oom", 3, 1), ("hang", 2, None)]
    for bad in ("boom@1", "nan_loss@x", "nan_loss"):
        with pytest.raises(ValueError, match="PFTEST_FAULT"):
            parse_faults(bad)
