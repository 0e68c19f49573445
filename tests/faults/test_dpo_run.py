"""``objective=dpo`` in a real Trainer (one gloo rank in this process): it trains on packed pairs, is preempted
(a stop signal mid-run: a checkpoint at the step boundary) and resumes bitwise (the same data order, losses,
rewards, evals and weights), with the live reference and with ``dpo.reference=precompute``; a resume refusing
a changed beta says so in one line."""

from __future__ import annotations

import json
import logging
import os
import re
import signal

import pytest
import torch

from tests.conftest import compose_job
from tests.faults.conftest import one_rank_world
from trainer.checkpoint import complete_checkpoints
from trainer.config import ConfigError

DPO_RUN = [
    "recipe=cpu_dpo",
    "data.num_records=120",
    "data.max_length=512",
    "packing.token_budget=512",
    "max_steps=4",
    "checkpoint.every_steps=3",
    "eval.every=2",
    "eval.holdout_fraction=0.1",
    "optim.warmup_steps=0",
    "logger.peak_tflops=1",
    "model.self_check=false",
]
"""Checkpoints by cadence after step 3 and at the end (4): one after step 1 or 2 comes from a stop signal."""


def run(run_dir, *extra):
    from trainer.loop import Trainer

    trainer = Trainer(compose_job([*DPO_RUN, f"run_dir={run_dir}", *extra]))
    trainer.result = trainer.train()
    return trainer


def records(run_dir, name="metrics.jsonl"):
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def signal_self(monkeypatch, owner, method: str, signum: int, call: int = 1) -> None:
    """This process sends itself ``signum`` as ``owner.method`` starts its ``call``-th run, as a scheduler's
    SIGTERM (or SLURM's SIGUSR1) reaches a trainer mid-run: the loop's handler (``trainer.preemption``) takes it."""
    original, calls = getattr(owner, method), []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signum)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, method, signalled)


def preempted_then_resumed(monkeypatch, run_dir, owner, method: str, signum: int, step: int, *extra):
    """A run stopped by ``signum`` (sent in ``owner.method``) after ``step``, with the checkpoint of that step
    only, then ``resume=auto`` to the end. Returns the resumed Trainer."""
    with monkeypatch.context() as patch:
        signal_self(patch, owner, method, signum)
        stopped = run(run_dir, *extra)
    assert stopped.result["preempted"] == signal.Signals(signum).name and stopped.result["step"] == step
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == [f"step_{step:08d}"]
    assert [r["step"] for r in records(run_dir)] == list(range(1, step + 1))
    return run(run_dir, "resume=auto", *extra)


def assert_same_run(a, b, run_a, run_b) -> None:
    """Bitwise: every step's loss, gradient norm, useful tokens and DPO metrics, every eval, every weight."""
    keys = ("step", "loss", "grad_norm", "useful_tokens", "preference")
    assert [[r[k] for k in keys] for r in records(run_b)] == [[r[k] for k in keys] for r in records(run_a)]

    def same(es):  # what two runs share (their times differ)
        return [(e["step"], e["eval_loss"], e["preference"]) for e in es]

    assert same(records(run_a, "eval.jsonl")) == same(records(run_b, "eval.jsonl"))
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor())


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """One uninterrupted DPO run (the live reference) both tests compare with. It also runs the startup
    self-check: a batch of whole pairs, the DPO loss's gradient (``PairLossCheck``)."""
    run_dir = tmp_path_factory.mktemp("dpo") / "whole"
    lines, loggers = Lines(), [logging.getLogger("trainer")]  # the loop's logger, parent of the self-check's
    for logger in loggers:
        logger.addHandler(lines)
    try:
        with one_rank_world():
            trainer = run(run_dir, "model.self_check=true")
    finally:
        for logger in loggers:
            logger.removeHandler(lines)
    log = "\n".join(lines.lines)
    assert re.search(
        r"certified exact: .*; self-check packed micro-batch .* max \|sequence log-prob diff\| .* gradient gap "
        r"\S+ \(dpo sigmoid loss;",
        log,
    ), log
    assert re.search(r"startup self-check batch: \d+ preference pairs", log), log
    return trainer, run_dir


def test_dpo_trains_is_preempted_in_its_eval_resumes_bitwise_and_refuses_a_changed_beta(
    live_run, tmp_path, monkeypatch
):
    """SIGTERM during the step-2 DPO eval (the watchdog's grace covers the eval): the eval ends, the step-2
    checkpoint is saved, the run returns preempted; ``resume=auto`` rebuilds the frozen reference from the
    starting weights and trains steps 3-4 as the run never stopped."""
    from trainer.objectives import DPO

    whole, whole_dir = live_run
    with one_rank_world():
        resumed = preempted_then_resumed(monkeypatch, tmp_path / "cut", DPO, "evaluate", signal.SIGTERM, 2)
        with pytest.raises(ConfigError, match=r"dpo\.beta: 0\.1 -> 0\.3"):
            run(tmp_path / "cut", "resume=auto", "dpo.beta=0.3", "max_steps=6")
    steps = records(whole_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[0]["preference"]["rewards/margins"] == 0.0
    assert abs(steps[0]["loss"] - 0.6931) < 1e-3  # the policy starts as its reference: log 2 per pair
    # the frozen copy is held in the compute dtype (bf16), the policy in fp32 cast by FSDP2 per forward: the
    # same forward, so the margins above are exactly 0 at step 1
    assert {p.dtype for p in whole.objective.reference.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in whole.model.parameters()} == {torch.float32}
    evals = records(whole_dir, "eval.jsonl")
    assert [e["step"] for e in evals] == [2, 4] and evals[-1]["preference"]["eval_pairs"] > 0
    assert_same_run(whole, resumed, whole_dir, tmp_path / "cut")
    summary = json.loads((whole_dir / "summary.json").read_text())
    assert summary["objective"] == "dpo" and 0 <= summary["final_eval_rewards/accuracies"] <= 1


def test_precomputed_reference_trains_is_preempted_resumes_bitwise_and_matches_the_live_one(
    live_run,
    tmp_path,
    monkeypatch,
):
    """``dpo.reference=precompute``: one pass before training (the policy resharded after it, so the optimizer
    holds the sharded parameters and checkpoints save), then the live reference's losses; preempted after
    step 1 (SIGUSR1), the resumed run reads the stored log-probs (the starting weights' fingerprint) and
    trains the uninterrupted run's steps bitwise."""
    from trainer.loop import Trainer

    with one_rank_world():
        pre = run(tmp_path / "pre", "dpo.reference=precompute")
        resumed = preempted_then_resumed(
            monkeypatch, tmp_path / "cut", Trainer, "train_step", signal.SIGUSR1, 1, "dpo.reference=precompute"
        )
    held = [p for group in pre.optimizer.param_groups for p in group["params"]]
    assert all(hasattr(p, "full_tensor") for p in held)  # the sharded parameters, not gathered copies
    assert resumed.objective.reference.fingerprint == pre.objective.reference.fingerprint
    assert_same_run(pre, resumed, tmp_path / "pre", tmp_path / "cut")
    live = records(live_run[1])
    for a, b in zip(
        live, records(tmp_path / "pre"), strict=True
    ):  # bf16 compute: the pass's bins differ from training's
        assert (
            abs(a["loss"] - b["loss"]) < 2e-3
            and abs(a["preference"]["rewards/margins"] - b["preference"]["rewards/margins"]) < 2e-3
        )
