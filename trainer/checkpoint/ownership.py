"""What packfsdp may delete or overwrite in a checkpoint dir: only what it can prove it wrote.

- Every checkpoint folder (``step_XXXXXXXX`` and its ``.tmp`` / ``.pruned`` / ``.replaced`` forms) holds
  ``.packfsdp`` (packfsdp's marker and the run id), written first, when the folder is created. Leftovers of
  a kill are removed only when their marker names this run; a folder without one (another tool's
  ``step_1000/``, ``step_best/``) is never touched.
- A checkpoint dir belongs to one run (``claim_checkpoint_dir``): ``.packfsdp_owner.json`` names it. A
  second run pointed at it (two runs sharing ``checkpoint.dir``) is refused in one line, and so is a folder
  holding files packfsdp did not write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.checkpoint.discovery import TRAINER_STATE, read_json
from trainer.config import ConfigError

MARKER = ".packfsdp"
"""In every checkpoint folder: ``{"writer": "packfsdp", "run_id": ...}``."""
OWNER_FILE = ".packfsdp_owner.json"
"""In a checkpoint dir: the run that owns it (``run_id``, ``run_dir``)."""
_OWN_LEFTOVERS = (".write_probe.",)


class CheckpointDirError(ConfigError):
    """The checkpoint dir belongs to another run or holds files packfsdp did not write (exit code 2)."""


def write_marker(folder: Path, run_id: str | None) -> None:
    with open(folder / MARKER, "x") as f:  # "x": never through an existing file or link
        json.dump({"writer": "packfsdp", "run_id": run_id}, f)


def marked_by(folder: Path, run_id: str | None) -> bool:
    """Whether ``folder`` is a checkpoint folder packfsdp wrote for run ``run_id``."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    marker = read_json(folder / MARKER)
    if marker.get("writer") == "packfsdp":
        return marker.get("run_id") == run_id
    # Checkpoints written before markers existed: complete ones carry the run id in their trainer state.
    saved = read_json(folder / TRAINER_STATE)
    return run_id is not None and saved.get("run_id") == run_id


def _before_run_ids(folder: Path) -> bool:
    """A complete checkpoint saved before run ids existed (no marker, no run id): the run dir's own, as
    ``Checkpointer.own`` counts it; claiming deletes nothing."""
    saved = read_json(folder / TRAINER_STATE)
    return folder.is_dir() and not (folder / MARKER).exists() and bool(saved) and saved.get("run_id") is None


def claim_checkpoint_dir(directory: Path, run_id: str, run_dir: Path) -> None:
    """Make ``directory`` this run's (rank 0), or refuse in one line (see the module doc)."""
    owner_file = directory / OWNER_FILE
    if owner_file.is_symlink():
        raise CheckpointDirError(f"checkpoint dir {directory}: {OWNER_FILE} is a symlink packfsdp did not create")
    owner = read_json(owner_file)
    if owner.get("run_id") == run_id:
        return
    if owner.get("run_id"):
        raise CheckpointDirError(
            f"checkpoint dir {directory} belongs to run {owner['run_id']} (run_dir {owner.get('run_dir')}); give "
            f"this run its own checkpoint.dir, or continue that run with run_dir={owner.get('run_dir')} resume=auto"
        )
    foreign = sorted(
        p.name for p in directory.iterdir()
        if not p.name.startswith(_OWN_LEFTOVERS) and not marked_by(p, run_id) and not _before_run_ids(p)
    )
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise CheckpointDirError(
            f"checkpoint dir {directory} holds files packfsdp did not write for this run ({shown}); give an empty "
            "or new checkpoint.dir (packfsdp never deletes what it did not write)"
        )
    tmp = directory / f"{OWNER_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps({"run_id": run_id, "run_dir": str(run_dir)}))
    os.replace(tmp, owner_file)
