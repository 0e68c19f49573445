"""Where checkpoints are and which are complete: names, the manifest's presence, ``resume=PATH`` lookup."""

from __future__ import annotations

import re
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
HF_DIR = "hf"
_NAME = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit this run."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints under ``directory`` (those with a manifest), oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name)) and (p / MANIFEST).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def find_checkpoint(spec: str | Path) -> Path:
    """A checkpoint from a path: the checkpoint itself, or the latest complete one in a checkpoints
    directory or in a run directory (``<run>/checkpoints``)."""
    path = Path(spec).expanduser()
    if (path / MANIFEST).is_file():
        return path
    for directory in (path, path / "checkpoints"):
        latest = latest_checkpoint(directory)
        if latest is not None:
            return latest
    if path.name.endswith(".tmp") or (path.is_dir() and _NAME.match(path.name)):
        raise CheckpointError(f"{path} is an incomplete checkpoint (no {MANIFEST}): a save did not finish")
    raise CheckpointError(f"no complete checkpoint at {path}")
