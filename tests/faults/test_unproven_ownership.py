"""Issue 33 (cases 1, 5, 7): packfsdp deletes, moves or replaces only what it can prove it wrote. A step folder
proves it is this run's only by the marker packfsdp writes first, with this run's id: a manifest and a
trainer state without it (another tool's, a copy, an older packfsdp's, a forgery) are refused at start and
never pruned; a file added to a checkpoint of this run is never deleted with it; ``export overwrite=true``
replaces only an export packfsdp wrote. In-process: no process is launched."""

from __future__ import annotations

import hashlib
import json
import logging
import os

import pytest

from tests.conftest import compose_job
from tests.faults.conftest import SMALL_RUN, one_rank_world
from tests.faults.test_nothing_lost import checkpointer_of, save_steps
from trainer.checkpoint import CheckpointError, complete_checkpoints
from trainer.checkpoint.ownership import MARKER, CheckpointDirError
from trainer.config import ConfigError
from trainer.tools.export import export

THESIS = "\\documentclass{article} four years of work"


def users_step_folder(directory, step: int = 99, state: dict | None = None):
    """What the issue found accepted: ``step_00000099/`` with a manifest listing ``trainer_state.json``
    (``{"step": 99}``, no run id) and the user's ``thesis.tex``."""
    folder = directory / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps(state if state is not None else {"step": step}))
    listed = {"trainer_state.json": {"bytes": (folder / "trainer_state.json").stat().st_size, "sha256": "0" * 64}}
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "step": step, "files": listed}))
    (folder / "thesis.tex").write_text(THESIS)
    return folder


def forge(kind: str, directory, tmp_path):
    folder = users_step_folder(
        directory, state={"step": 99, "run_id": "run-a"} if kind == "state names this run" else None
    )
    if kind == "marker of no run":
        (folder / MARKER).write_text(json.dumps({"writer": "packfsdp", "run_id": None}))
    elif kind == "marker linked from this run":  # a link to a real marker of this run, in another folder
        real = tmp_path / "real"
        real.mkdir()
        (real / MARKER).write_text(json.dumps({"writer": "packfsdp", "run_id": "run-a"}))
        os.symlink(real / MARKER, folder / MARKER)
    return folder


FORGERIES = ["no run id (case 1)", "state names this run", "marker of no run", "marker linked from this run"]


@pytest.mark.parametrize("kind", FORGERIES)
def test_a_step_folder_without_this_runs_marker_is_refused_at_start(kind, tmp_path):
    ckpt = tmp_path / "ckpts"
    folder = forge(kind, ckpt, tmp_path)
    with pytest.raises(
        CheckpointDirError, match=rf"checkpoint dir {ckpt} holds files packfsdp did not write .*step_00000099"
    ):
        checkpointer_of("run-a", tmp_path, ckpt, keep_last=1).check_writable()
    assert isinstance(CheckpointDirError("x"), ConfigError)  # exit code 2
    assert (folder / "thesis.tex").read_text() == THESIS


@pytest.mark.parametrize("kind", FORGERIES)
def test_a_step_folder_without_this_runs_marker_is_never_pruned_or_resumed(kind, tmp_path):
    """Past the start-time check (a library user's Checkpointer, a folder that appeared later): keep_last=1
    prunes this run's own checkpoints only, and resume=auto never picks the foreign one."""
    ckpt = tmp_path / "ckpts"
    folder = forge(kind, ckpt, tmp_path)
    checkpointer = checkpointer_of("run-a", tmp_path, ckpt, keep_last=1)
    assert checkpointer.resolve("auto") is None
    save_steps(checkpointer, (1, 2))
    assert [p.name for p in complete_checkpoints(ckpt)] == ["step_00000002", "step_00000099"]
    assert (folder / "thesis.tex").read_text() == THESIS
    assert checkpointer.resolve("auto").name == "step_00000002"


def test_a_pre_run_id_checkpoint_is_refused_at_start_not_at_the_first_save(tmp_path):
    """Case 7: a checkpoint an older packfsdp wrote (no marker, no run id) was accepted at start; one step
    trained, then the save failed with a traceback (exit 1). Now refused at start; a step folder that appears
    after the start is one line on every rank (a config error, exit 2), never replaced."""
    older = checkpointer_of(None, tmp_path)
    save_steps(older, (1,))
    (older.dir / "step_00000001" / MARKER).unlink()  # as packfsdp wrote checkpoints before markers and run ids
    assert json.loads((older.dir / "step_00000001" / "trainer_state.json").read_text())["run_id"] is None
    with pytest.raises(CheckpointDirError, match="holds files packfsdp did not write for this run .*step_00000001"):
        checkpointer_of("run-a", tmp_path).check_writable()
    late = checkpointer_of("run-a", tmp_path)  # no start-time check: the save itself refuses
    with pytest.raises(CheckpointDirError, match="step_00000001 was not written by this run; not replacing it"):
        save_steps(late, (1,))
    assert [p.name for p in complete_checkpoints(older.dir)] == ["step_00000001"]


def test_a_file_added_to_a_checkpoint_of_this_run_is_never_deleted(tmp_path, caplog):
    ckpt = tmp_path / "ckpts"
    checkpointer = checkpointer_of("run-a", tmp_path, ckpt, keep_last=1)
    state = save_steps(checkpointer, (1,))
    (ckpt / "step_00000001" / "notes.txt").write_text("the good one")
    with caplog.at_level(logging.WARNING):
        save_steps(checkpointer, (2,), state)
    assert "not pruning" in caplog.text and "notes.txt" in caplog.text
    assert (ckpt / "step_00000001" / "notes.txt").read_text() == "the good one"
    with pytest.raises(CheckpointDirError, match=r"step_00000001 holds files packfsdp did not write \(notes.txt\)"):
        save_steps(checkpointer, (1,), state)  # a save of the same step would replace it
    assert (ckpt / "step_00000001" / "notes.txt").read_text() == "the good one"


def test_a_checkpoint_dir_of_user_files_is_refused_before_the_data_and_the_model(tmp_path, monkeypatch):
    """Cases 1 and 7 through the trainer: refused right after the run dir is claimed (before the tokenizer,
    the data and the model are built), and the folder is untouched."""
    from trainer import loop

    ckpt = tmp_path / "ckpts"
    users_step_folder(ckpt)
    monkeypatch.setattr(loop, "load_tokenizer", lambda *a: pytest.fail("the start went on past the checkpoint dir"))
    with one_rank_world(), pytest.raises(CheckpointDirError, match="did not write for this run .step_00000099"):
        loop.Trainer(compose_job([*SMALL_RUN, f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={ckpt}"]))
    assert (ckpt / "step_00000099" / "thesis.tex").read_text() == THESIS


# ------------------------------------------------------------------------------------------------- export
def a_run(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002" / "__0_0.distcp").write_bytes(b"shard")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "run.json").write_text('{"run_id": "abc"}')
    return run


def users_folder(tmp_path):
    folder = tmp_path / "mine"
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.txt").write_text("notes")
    (folder / "sub" / "data.csv").write_text("a,b\n1,2\n")
    return folder


@pytest.mark.parametrize("make", [a_run, users_folder])
def test_export_overwrite_refuses_what_packfsdp_did_not_export(make, tmp_path):
    """Case 5: ``export checkpoint=RUN out=RUN overwrite=true`` deleted the run; over a folder of notes.txt and
    sub/data.csv it deleted both. Refused before any work (the slow end-to-end check, with a real checkpoint,
    is ``tests/distributed/test_export_overwrite.py``)."""
    folder = make(tmp_path)
    before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    with pytest.raises(
        CheckpointError, match=f"out={folder} is not an export packfsdp wrote .*overwrite=true replaces only"
    ):
        export(folder, folder, overwrite=True)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before


def previous_export(out):
    """An export as packfsdp records it (``trainer/tools/export_folder.py``): every file's size and SHA-256."""
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights")
    files = {"model.safetensors": {"bytes": 7, "sha256": hashlib.sha256(b"weights").hexdigest()}}
    (out / "packfsdp_export.json").write_text(json.dumps({"writer": "packfsdp", "step": 2, "files": files}))
    return out


def test_export_overwrite_refuses_an_export_changed_since(tmp_path):
    out = previous_export(tmp_path / "model")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):  # untouched: replaceable, on to the work
        export(tmp_path / "no-checkpoint", out, overwrite=True)
    (out / "model.safetensors").write_bytes(b"w3ights")
    with pytest.raises(CheckpointError, match="holds model.safetensors changed since the export wrote it"):
        export(tmp_path / "no-checkpoint", out, overwrite=True)
    (out / "model.safetensors").write_bytes(b"weights")
    (out / "README.md").write_text("my model card")
    with pytest.raises(CheckpointError, match=r"holds files the export did not write \(README.md\)"):
        export(tmp_path / "no-checkpoint", out, overwrite=True)
    (out / "README.md").unlink()
    (out / "packfsdp_export.json").write_text(json.dumps({"step": 2}))  # as exports were recorded before
    with pytest.raises(CheckpointError, match="is not an export packfsdp wrote .no packfsdp_export.json listing"):
        export(tmp_path / "no-checkpoint", out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "packfsdp_export.json"]
