"""Issue 33, case 5: ``packfsdp export ... overwrite=true`` replaces only an earlier export packfsdp wrote and
nobody changed since; a run directory (``out=RUN``, which deleted the run) and a folder of the user's files
are refused, untouched. Reads the shared reference run (no launch of its own)."""

from __future__ import annotations

import shutil

import pytest

from trainer.checkpoint import CheckpointError
from trainer.tools.export import export

pytestmark = pytest.mark.slow


def listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_overwrite_replaces_an_export_only(reference, tmp_path):
    run = shutil.copytree(reference / "run", tmp_path / "run")  # the shared run stays as it is whatever happens
    before = listing(run)
    with pytest.raises(CheckpointError, match=f"out={run} is not an export packfsdp wrote"):
        export(run, run, overwrite=True)
    assert listing(run) == before

    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("notes")
    (mine / "sub" / "data.csv").write_text("a,b\n")
    with pytest.raises(CheckpointError, match="is not an export packfsdp wrote"):
        export(run, mine, overwrite=True)
    assert listing(mine) == ["notes.txt", "sub", "sub/data.csv"]

    out = tmp_path / "hf"
    export(run, out)
    export(run, out, overwrite=True)  # its own earlier export: replaced
    (out / "notes.txt").write_text("mine now")
    with pytest.raises(CheckpointError, match=r"holds files the export did not write \(notes.txt\)"):
        export(run, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine now" and (out / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind
