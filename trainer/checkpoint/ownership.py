"""What packfsdp may delete or overwrite in a checkpoint dir: only what it can prove it wrote.

- Proof is ``.packfsdp`` (packfsdp's marker and the run id), a regular file written first, when a
  checkpoint folder (``step_XXXXXXXX`` and its ``.tmp`` / ``.pruned`` / ``.replaced`` forms) is created.
  Nothing else counts: a complete-looking step folder (a manifest, a trainer state) without the marker of
  this run (another tool's ``step_1000/``, a copy, a checkpoint of an older packfsdp, a forged one) is never
  resumed by ``resume=auto``, pruned, moved or replaced.
- Inside a folder it wrote, packfsdp removes only what its manifest lists: a folder holding anything else
  (``notes.txt`` added later) is kept as it is (``foreign_files``).
- A checkpoint dir belongs to one run (``claim_checkpoint_dir``): ``.packfsdp_owner.json`` names it. A
  second run pointed at it (two runs sharing ``checkpoint.dir``) is refused in one line, and so is a
  folder holding anything packfsdp did not write for this run, at start, before a step is trained.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.checkpoint.discovery import MANIFEST, CheckpointError, read_json
from trainer.config import ConfigError

MARKER = ".packfsdp"
"""In every checkpoint folder: ``{"writer": "packfsdp", "run_id": ...}``."""
OWNER_FILE = ".packfsdp_owner.json"
"""In a checkpoint dir: the run that owns it (``run_id``, ``run_dir``)."""
_OWN_LEFTOVERS = (".write_probe.",)


class CheckpointDirError(CheckpointError, ConfigError):
    """The checkpoint dir belongs to another run or holds files packfsdp did not write (exit code 2)."""


def write_marker(folder: Path, run_id: str | None) -> None:
    with open(folder / MARKER, "x") as f:  # "x": never through an existing file or link
        json.dump({"writer": "packfsdp", "run_id": run_id}, f)


def marked_by(folder: Path, run_id: str | None) -> bool:
    """Whether ``folder`` is a checkpoint folder packfsdp wrote for run ``run_id``: its marker (a regular
    file, not a link to another folder's) names packfsdp and this run."""
    marker = folder / MARKER
    if folder.is_symlink() or not folder.is_dir() or marker.is_symlink():
        return False
    found = read_json(marker)
    return found.get("writer") == "packfsdp" and found.get("run_id") == run_id


def foreign_files(folder: Path) -> list[str]:
    """What a checkpoint folder of this run holds besides the files its manifest lists (and the manifest): a
    file someone added later, which removing the folder would delete with it. A folder without a readable
    manifest (left by a kill during a save) has only its marker to say what it is: all of it is packfsdp's."""
    listed = read_json(folder / MANIFEST).get("files")
    if not isinstance(listed, dict):
        return []
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if (p.is_symlink() or not p.is_dir()) and p.name != MANIFEST and str(p.relative_to(folder)) not in listed
    )


def shown(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


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
        p.name for p in directory.iterdir() if not p.name.startswith(_OWN_LEFTOVERS) and not marked_by(p, run_id)
    )
    if foreign:
        raise CheckpointDirError(
            f"checkpoint dir {directory} holds files packfsdp did not write for this run ({shown(foreign)}); give "
            "an empty or new checkpoint.dir (packfsdp never deletes what it did not write; a checkpoint there can "
            "still be read with resume=PATH)"
        )
    tmp = directory / f"{OWNER_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps({"run_id": run_id, "run_dir": str(run_dir)}))
    os.replace(tmp, owner_file)
