"""Issue 14, bullet 2: a run dir belongs to one run. A live lock refuses a second run (a stale one is taken
over); a new run into a directory that holds a run is refused with a hint; checkpoints carry the run id, so
``resume=auto`` and pruning never touch another run's; pruning never deletes the checkpoint just written."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.faults.conftest import train_process
from tests.unit.test_checkpoint import make_state, train_a_little
from trainer.checkpoint import Checkpointer, complete_checkpoints
from trainer.config import CheckpointConfig
from trainer.run_dir import LOCK_FILE, RUN_FILE, RunDirError, _process_start, job_token, own_run_id, take_lock


def write_lock(path, **fields) -> None:
    (path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "torchrun_id": "none"} | fields))


def test_a_live_lock_refuses_a_second_run_and_a_stale_one_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(tmp_path, pid=holder.pid, started=_process_start(holder.pid), torchrun_id="job-a")
        with pytest.raises(RunDirError, match=rf"in use by pid {holder.pid} on .*delete .*{LOCK_FILE}"):
            take_lock(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    take_lock(tmp_path)  # its process is gone: stale
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    # Another host's lock cannot be checked by pid, unless it is an earlier attempt of this very job
    # (a torchrun restart: the same agent's job token; a SLURM requeue: the same SLURM_JOB_ID).
    write_lock(tmp_path, host="elsewhere", pid=1, job_token="elsewhere:1:99")
    with pytest.raises(RunDirError):
        take_lock(tmp_path)
    write_lock(tmp_path, host="elsewhere", pid=1, job_token=job_token())
    take_lock(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    write_lock(tmp_path, host="elsewhere", pid=1, slurm_job="4242")
    take_lock(tmp_path)


def test_a_new_run_into_a_run_dir_that_holds_a_run_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    first = own_run_id(tmp_path, "none")
    assert json.loads((tmp_path / RUN_FILE).read_text())["run_id"] == first
    with pytest.raises(
        RunDirError, match="already holds a run .*add resume=auto to continue it, or give a new run_dir"
    ):
        own_run_id(tmp_path, "none")
    assert own_run_id(tmp_path, "auto") == first  # continuing keeps the run id
    legacy = tmp_path / "legacy"
    (legacy / "checkpoints").mkdir(parents=True)  # a run dir written before run ids
    with pytest.raises(RunDirError):
        own_run_id(legacy, "none")


def saved_by(run_id: str, directory, steps, keep_last: int = 3) -> Checkpointer:
    checkpointer = Checkpointer(CheckpointConfig(keep_last=keep_last), directory, run_id=run_id)
    state = make_state()
    for step in steps:
        train_a_little(state, steps=1)
        checkpointer.save(step, state, tokens_seen=step, total_steps=40)
    return checkpointer


def names(checkpointer: Checkpointer) -> list[str]:
    return [p.name for p in complete_checkpoints(checkpointer.dir)]


def test_resume_auto_and_pruning_keep_to_their_own_run(tmp_path):
    saved_by("old", tmp_path, steps=(10, 20, 30))
    new = saved_by("new", tmp_path, steps=(2, 4), keep_last=1)
    # The old run's higher steps are neither pruned by, nor resumed as, the new run's.
    assert names(new) == ["step_00000004", "step_00000010", "step_00000020", "step_00000030"]
    assert new.resolve("auto").name == "step_00000004"
    assert Checkpointer(CheckpointConfig(), tmp_path, run_id="third").resolve("auto") is None


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    checkpointer = saved_by("run", tmp_path, steps=(10,), keep_last=1)
    checkpointer.save(4, make_state(), tokens_seen=4, total_steps=40)  # e.g. a resume from an earlier step
    assert "step_00000004" in names(checkpointer)


@pytest.mark.slow
def test_second_run_into_the_same_run_dir_is_one_line(copy_of_finished_run):
    run_dir = copy_of_finished_run  # a finished run's dir: config.yaml, metrics, checkpoints
    config_before = (run_dir / "config.yaml").read_text()
    refused = train_process("max_steps=1", f"run_dir={run_dir}", "optim.lr=0.5")
    assert refused.returncode == 2
    lines = [line for line in refused.stderr.splitlines() if line.startswith("packfsdp:")]
    assert len(lines) == 1 and "already holds a run" in lines[0] and "resume=auto" in lines[0], refused.stderr[-2000:]
    assert (run_dir / "config.yaml").read_text() == config_before  # the refused run changed nothing
