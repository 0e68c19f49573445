"""Issue 24: packfsdp deletes or overwrites only what it can prove it wrote, and refuses damaged state
instead of starting over. In-process (Checkpointers on a tiny model, the run-dir claim on a composed
config): no process is launched."""

from __future__ import annotations

import json
import logging

import pytest

from tests.conftest import compose_job
from tests.unit.test_checkpoint import distcp_file, make_state, train_a_little
from trainer.checkpoint import Checkpointer, CheckpointError, complete_checkpoints, verify_checkpoint
from trainer.checkpoint.discovery import DamagedCheckpointsError
from trainer.checkpoint.ownership import CheckpointDirError
from trainer.config import CheckpointConfig, ConfigError
from trainer.run_dir import RUN_FILE, RunDirError, choose_run_dir, claim_run_dir, job_token, own_run_id


def checkpointer_of(run_id, run_dir, directory=None, keep_last=3) -> Checkpointer:
    cfg = CheckpointConfig(keep_last=keep_last, dir=str(directory) if directory else None)
    return Checkpointer(cfg, run_dir, run_id=run_id)


def save_steps(checkpointer: Checkpointer, steps, state=None):
    state = state or make_state()
    for step in steps:
        train_a_little(state, steps=1)
        checkpointer.save(step, state, tokens_seen=step, total_steps=40)
    return state


def test_two_runs_sharing_a_checkpoint_dir_the_second_is_refused(tmp_path):
    shared = tmp_path / "S"
    first = checkpointer_of("run-a", tmp_path / "a", shared)
    first.check_writable()  # claims S for run-a
    save_steps(first, (3, 6))
    second = checkpointer_of("run-b", tmp_path / "b", shared)
    with pytest.raises(CheckpointDirError, match=rf"checkpoint dir {shared} belongs to run run-a .*own checkpoint.dir"):
        second.check_writable()
    assert isinstance(CheckpointDirError("x"), ConfigError)  # exit code 2
    first.check_writable()  # its owner continues
    assert [p.name for p in complete_checkpoints(shared)] == ["step_00000003", "step_00000006"]


def test_folders_packfsdp_did_not_write_are_never_deleted(tmp_path):
    ckpt = tmp_path / "ckpts"
    for name in ("step_1000", "step_best", "step_by_step", "step_00000009"):  # another tool's checkpoints
        (ckpt / name).mkdir(parents=True)
        (ckpt / name / "weights.bin").write_bytes(b"w")
    (ckpt / "step_00000002.tmp").mkdir()  # not packfsdp's .tmp either
    with pytest.raises(
        CheckpointDirError, match="holds files packfsdp did not write .*step_00000002.tmp, step_00000009"
    ):
        checkpointer_of("run-a", tmp_path, ckpt).check_writable()
    legacy = checkpointer_of(None, tmp_path, ckpt)  # no claim (a library user): saves and cleans anyway
    save_steps(legacy, (4,))
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "step_00000002.tmp",
        "step_00000004",
        "step_00000009",
        "step_1000",
        "step_best",
        "step_by_step",
    ]


def test_a_step_folder_of_another_run_is_never_replaced(tmp_path):
    save_steps(checkpointer_of("run-a", tmp_path), (3,))
    with pytest.raises(CheckpointError, match="not written by this run; not replacing it"):
        save_steps(checkpointer_of("run-b", tmp_path), (3,))
    assert json.loads((tmp_path / "checkpoints/step_00000003/trainer_state.json").read_text())["run_id"] == "run-a"


def test_a_run_dir_of_user_files_or_symlinks_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    users = tmp_path / "mine"
    users.mkdir()
    for name in ("config.yaml", "summary.json", "eval.jsonl"):
        (users / name).write_text("the user's")
    cfg = compose_job(["recipe=cpu_dailydialog", f"run_dir={users}"])
    with pytest.raises(
        RunDirError, match=rf"run_dir {users} holds files packfsdp did not write \(config.yaml, eval.jsonl"
    ):
        claim_run_dir(cfg)
    assert all((users / n).read_text() == "the user's" for n in ("config.yaml", "summary.json", "eval.jsonl"))
    assert not (users / ".lock").exists()

    ours = tmp_path / "ours"
    cfg = compose_job(["recipe=cpu_dailydialog", f"run_dir={ours}", "resume=auto"])
    claim_run_dir(cfg)
    (ours / ".lock").unlink()
    target = tmp_path / "precious.yaml"
    target.write_text("keep me")
    (ours / "config.yaml").unlink()
    (ours / "config.yaml").symlink_to(target)
    with pytest.raises(RunDirError, match="config.yaml is a symlink packfsdp did not create"):
        claim_run_dir(cfg)
    assert target.read_text() == "keep me"


def test_a_quoted_tilde_run_dir_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert choose_run_dir(compose_job(["recipe=cpu_dailydialog", "run_dir='~/x'"])) == tmp_path / "x"


def test_a_reused_rdzv_id_is_not_a_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "exp42")
    (tmp_path / RUN_FILE).write_text(
        json.dumps({"run_id": "first", "job_token": "host:1234:99", "torchrun_id": "exp42"})
    )
    with pytest.raises(RunDirError, match="already holds a run"):
        own_run_id(tmp_path, "none")  # the same --rdzv-id from another torchrun launch: a new experiment
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "first", "job_token": job_token()}))
    assert own_run_id(tmp_path, "none") == "first"  # an attempt under this very torchrun agent
    # The run dir an earlier launch chose under the same --rdzv-id is not reused either.
    root = tmp_path / "out"
    marker = root / "exp" / ".by_run_id" / "exp42"
    marker.parent.mkdir(parents=True)
    (root / "earlier").mkdir()
    marker.write_text(json.dumps({"dir": str(root / "earlier"), "job_token": "host:1234:99"}))
    cfg = compose_job(["recipe=cpu_dailydialog", f"output_root={root}", "name=exp"])
    assert choose_run_dir(cfg) != root / "earlier"
    assert choose_run_dir(cfg) == choose_run_dir(cfg)  # ... while a restart of this job finds its own


def damage(checkpoint) -> None:
    shard = distcp_file(checkpoint)
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated


def test_resume_auto_refuses_when_no_checkpoint_verifies(tmp_path):
    checkpointer = checkpointer_of("run-a", tmp_path)
    save_steps(checkpointer, (2, 4))
    for step in ("step_00000002", "step_00000004"):
        damage(checkpointer.dir / step)
    with pytest.raises(DamagedCheckpointsError, match=r"none of the 2 checkpoint\(s\) .*step_00000004, step_00000002"):
        checkpointer_of("run-a", tmp_path).resolve("auto")
    assert isinstance(DamagedCheckpointsError("x"), ConfigError)  # exit code 2


def test_a_damaged_checkpoint_is_never_pruned_or_replaced(tmp_path, caplog):
    checkpointer = checkpointer_of("run-a", tmp_path, keep_last=1)
    state = save_steps(checkpointer_of("run-a", tmp_path, keep_last=3), (2, 4))
    damage(checkpointer.dir / "step_00000004")
    assert checkpointer.resolve("auto").name == "step_00000002"
    with caplog.at_level(logging.WARNING):
        save_steps(checkpointer, (4,), state)  # the step of the damaged one is saved again
    kept = [p.name for p in checkpointer.dir.iterdir() if ".damaged-" in p.name]
    assert len(kept) == 1 and "did not verify: kept as" in caplog.text
    damage(checkpointer.dir / "step_00000004")  # damaged after the resume: found by its sizes, not pruned
    save_steps(checkpointer, (6,), state)
    assert [p.name for p in complete_checkpoints(checkpointer.dir)] == ["step_00000004", "step_00000006"]


def test_a_manifest_must_list_every_file_the_dcp_metadata_needs(tmp_path):
    checkpointer = checkpointer_of("run-a", tmp_path)
    save_steps(checkpointer, (2,))
    path = checkpointer.dir / "step_00000002"
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(manifest | {"files": {}}))
    with pytest.raises(CheckpointError, match="does not list .metadata"):
        verify_checkpoint(path)
    shard = distcp_file(path).name
    files = {k: v for k, v in manifest["files"].items() if k != shard}
    (path / "manifest.json").write_text(json.dumps(manifest | {"files": files}))
    with pytest.raises(CheckpointError, match=f"does not list {shard}, which the DCP metadata needs"):
        verify_checkpoint(path)
    files = {k: v for k, v in manifest["files"].items() if not k.startswith("rng/")}
    (path / "manifest.json").write_text(json.dumps(manifest | {"files": files}))
    with pytest.raises(CheckpointError, match="rank 0's RNG state"):
        verify_checkpoint(path)


def test_export_refuses_a_folder_that_holds_files(tmp_path):
    from trainer.tools.export import export

    out = tmp_path / "model"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"someone's model")
    with pytest.raises(CheckpointError, match=f"out={out} is not empty; .*overwrite=true"):
        export(tmp_path / "no-checkpoint-needed", out)
    assert (out / "model.safetensors").read_bytes() == b"someone's model"
