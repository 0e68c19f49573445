"""Issue 14, bullet 1: SIGTERM / SIGUSR1 stop every rank at the same step boundary with a checkpoint and exit
code 75; ``resume=auto`` then continues bitwise exactly (2 gloo ranks under torchrun)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_torchrun, wait_until
from tests.faults.conftest import SMALL_RUN
from trainer.checkpoint import complete_checkpoints
from trainer.stop_signals import PREEMPTED_EXIT_CODE

RUN = [*SMALL_RUN, "max_steps=12", "eval.every=4", "checkpoint.every_steps=0", "checkpoint.every_minutes=0"]


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records}


def preempted_lines(out) -> list[str]:
    return [line for line in out.stderr.splitlines() if line.startswith("packfsdp: ") and "preempted" in line]


def signalled_run(run_dir: Path, spec: str):
    return run_torchrun(["-m", "tests.faults.signal_entry", *RUN, f"run_dir={run_dir}"], env={"PFTEST_SIGNAL": spec})


@pytest.mark.slow
def test_sigterm_mid_run_saves_then_resume_auto_matches_the_uninterrupted_run(tmp_path):
    reference = run_torchrun(["-m", "trainer.train", *RUN, f"run_dir={tmp_path / 'ref'}"])
    assert reference.returncode == 0, reference.stderr[-3000:]

    run = tmp_path / "run"
    out = signalled_run(run, "SIGTERM:parent:0:5")  # the scheduler's SIGTERM reaches torchrun
    lines = preempted_lines(out)
    assert len(lines) == 2, out.stderr[-3000:]
    stopped = {int(line.split("after step ")[1].split(":")[0]) for line in lines}
    assert len(stopped) == 1, lines  # both ranks stopped after the same step
    (step,) = stopped
    assert 5 <= step < 12 and "SIGTERM" in lines[0]
    assert complete_checkpoints(run / "checkpoints")[-1].name == f"step_{step:08d}"
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in out.stderr or f"exit code {PREEMPTED_EXIT_CODE}" in out.stderr

    resumed = run_torchrun(["-m", "trainer.train", *RUN, f"run_dir={run}", "resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(run) == losses(tmp_path / "ref")  # every step, bitwise: nothing lost, nothing repeated
    evals = [json.loads(line)["step"] for line in (run / "eval.jsonl").read_text().splitlines()]
    assert evals == [4, 8, 12]


@pytest.mark.slow
def test_sigusr1_on_one_rank_stops_both_ranks_at_the_same_step(tmp_path):
    out = signalled_run(tmp_path, "SIGUSR1:self:1:3")  # SLURM's --signal=USR1, seen by rank 1 only
    lines = preempted_lines(out)
    assert sorted(line.split(":")[1] for line in lines) == [" rank 0", " rank 1"], out.stderr[-3000:]
    assert all("(SIGUSR1) after step 3:" in line for line in lines), lines
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in out.stderr
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step_00000003"]
    assert sorted(losses(tmp_path)) == [1, 2, 3]


@pytest.mark.parametrize("recipe", ["cpu_chat_sft", "cpu_dailydialog", "gpt2_dailydialog", "qwen_chat_sft"])
def test_recipes_checkpoint_by_default(recipe):
    from tests.conftest import compose_job

    cfg = compose_job([f"recipe={recipe}"]).checkpoint
    assert cfg.every_steps > 0 or cfg.every_minutes > 0


@pytest.mark.slow
def test_slurm_script_forwards_the_signal_and_requeues(tmp_path):
    """SLURM's ``--signal=B:USR1`` reaches the batch script: it forwards the signal to the job step (a fake
    ``srun`` that exits 75 as a preempted trainer does) and requeues the job."""
    import os
    import signal
    import subprocess

    from tests.conftest import REPO

    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        f'#!/usr/bin/env bash\nif [ "$1" = show ]; then echo node1; else echo "scontrol $*" >> {log}; fi\n'
    )
    (bin_dir / "srun").write_text(
        f"#!/usr/bin/env bash\ntrap 'echo \"srun got USR1\" >> {log}; exit {PREEMPTED_EXIT_CODE}' USR1\n"
        f"touch {tmp_path / 'started'}\nwhile true; do sleep 0.1; done\n"
    )
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "777",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_GPUS_ON_NODE": "1",
        "SLURM_SUBMIT_DIR": str(REPO),
    }
    script = subprocess.Popen(
        ["bash", str(REPO / "launch/slurm_hsdp.sbatch")], env=env, stderr=subprocess.PIPE, text=True
    )
    # Polled, then signalled: the fake srun starts asynchronously, later on a loaded machine.
    wait_until((tmp_path / "started").exists, 20, what="the fake srun's start")
    script.send_signal(signal.SIGUSR1)
    _, err = script.communicate(timeout=20)
    assert script.returncode == PREEMPTED_EXIT_CODE, err
    assert log.read_text().splitlines() == ["srun got USR1", "scontrol requeue 777"]
    assert "#SBATCH --signal=B:USR1@" in (REPO / "launch/slurm_hsdp.sbatch").read_text()


def test_a_rank_stuck_after_the_signal_exits_and_one_that_saves_is_left_alone(monkeypatch):
    """The watchdog (``trainer.preemption``): a signal with no step boundary in time ends the rank, as the
    signal alone would have; a boundary in time, or a save in progress, does not."""
    import os
    import signal
    import time

    import torch

    from trainer import preemption

    stuck = []
    monkeypatch.setattr(preemption, "MIN_GRACE_S", 0.2)
    monkeypatch.setattr(preemption.StepBoundary, "_stuck", lambda self, signum: stuck.append(signum))
    with preemption.StepBoundary(0, torch.device("cpu")) as boundary:
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_until(lambda: stuck, 30, what="the watchdog's call after a 0.2 s grace")
    assert stuck == [signal.SIGUSR1]

    stuck.clear()
    before = signal.getsignal(signal.SIGTERM)
    # A grace of 1 s: the step's grace restarts when the save ends; 0.2 s between that and agree() below was
    # too short a window on a loaded machine (the watchdog fired in it).
    monkeypatch.setattr(preemption, "MIN_GRACE_S", 1.0)
    with preemption.StepBoundary(0, torch.device("cpu")) as boundary:
        with boundary.saving_checkpoint():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.2)  # a save longer than the grace is not cut short
        assert stuck == [] and boundary.agree().stop_signal == "SIGTERM"
        time.sleep(0.4)
    assert stuck == []
    assert signal.getsignal(signal.SIGTERM) == before  # outside the loop, nothing changed
