"""``objective=dpo`` in a real Trainer (one gloo rank in this process): it trains on packed pairs, resumes
bitwise (the same data order, losses, rewards and weights), and a resume refusing a changed beta says so
in one line."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.conftest import compose_job
from tests.faults.conftest import one_rank_world
from trainer.config import ConfigError

DPO_RUN = [
    "recipe=cpu_dpo", "data.num_records=120", "data.max_length=512", "packing.token_budget=512", "max_steps=4",
    "checkpoint.every_steps=2", "eval.every=2", "eval.holdout_fraction=0.1", "optim.warmup_steps=0",
    "logger.peak_tflops=1", "model.self_check=false",
]


def run(run_dir, *extra):
    from trainer.loop import Trainer

    trainer = Trainer(compose_job([*DPO_RUN, f"run_dir={run_dir}", *extra]))
    trainer.train()
    return trainer


def records(run_dir, name="metrics.jsonl"):
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def test_dpo_trains_resumes_bitwise_and_refuses_a_changed_beta(tmp_path):
    with one_rank_world():
        whole = run(tmp_path / "whole")
        run(tmp_path / "cut", "stop_after_steps=2")
        resumed = run(tmp_path / "cut", "resume=auto")
        with pytest.raises(ConfigError, match=r"dpo\.beta: 0\.1 -> 0\.3"):
            run(tmp_path / "cut", "resume=auto", "dpo.beta=0.3", "max_steps=6")
    steps = records(tmp_path / "whole")
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[0]["preference"]["rewards/margins"] == 0.0
    assert abs(steps[0]["loss"] - 0.6931) < 1e-3  # the policy starts as its reference: log 2 per pair
    cut = records(tmp_path / "cut")
    keys = ("loss", "grad_norm", "useful_tokens", "preference")
    assert [[r[k] for k in keys] for r in cut] == [[r[k] for k in keys] for r in steps]  # bitwise
    evals = records(tmp_path / "whole", "eval.jsonl")
    assert [e["step"] for e in evals] == [2, 4] and evals[-1]["preference"]["eval_pairs"] > 0
    same = lambda es: [(e["step"], e["eval_loss"], e["preference"]) for e in es]  # noqa: E731 (times differ)
    assert same(evals) == same(records(tmp_path / "cut", "eval.jsonl"))
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor())
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["objective"] == "dpo" and 0 <= summary["final_eval_rewards/accuracies"] <= 1


def test_precomputed_reference_trains_checkpoints_and_matches_the_live_one(tmp_path, capsys):
    """``dpo.reference=precompute``: one pass before training (the policy resharded after it, so the optimizer
    holds the sharded parameters and checkpoints save), then the same losses as a live reference. The live
    run also runs the startup self-check: a batch of whole pairs, the DPO loss's gradient (``PairLossCheck``)."""
    with one_rank_world():
        run(tmp_path / "live", "max_steps=2", "model.self_check=true")
        log = capsys.readouterr().out
        trainer = run(tmp_path / "pre", "max_steps=2", "dpo.reference=precompute")
    assert re.search(r"startup self-check passed: packed micro-batch .* max \|sequence log-prob diff\| .* gradient gap "
                     r"\S+ \(dpo sigmoid loss;", log), log
    assert re.search(r"startup self-check batch: \d+ preference pairs", log), log
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert all(hasattr(p, "full_tensor") for p in held)  # the sharded parameters, not gathered copies
    live, pre = records(tmp_path / "live"), records(tmp_path / "pre")
    assert (tmp_path / "pre" / "checkpoints" / "step_00000002").is_dir()
    for a, b in zip(live, pre):  # bf16 compute: the reference pass's bins differ from training's
        assert abs(a["loss"] - b["loss"]) < 2e-3 and abs(a["preference"]["rewards/margins"] - b["preference"]["rewards/margins"]) < 2e-3
