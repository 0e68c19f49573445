"""Where checkpoints are and which are complete: names, the manifest's presence, ``resume=PATH`` lookup."""

from __future__ import annotations

import json
import re
from pathlib import Path

from trainer.config import ConfigError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
HF_DIR = "hf"
_NAME = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit this run."""


class DamagedCheckpointsError(CheckpointError, ConfigError):
    """``resume=auto`` found this run's checkpoints and none verifies: refused (exit code 2), not restarted."""


def dcp_failure(exc: BaseException, what: str) -> CheckpointError:
    """DCP's ``CheckpointException`` (a ``BaseException``, so ``except Exception`` misses it, and its text is a
    traceback per rank) as a ``CheckpointError`` of one line naming the first failing rank and its error."""
    failures = getattr(exc, "failures", {}) or {}
    if not failures:
        return CheckpointError(f"{what} failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}")
    rank, (cause, _) = min(failures.items())
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return CheckpointError(f"{what} failed on rank {rank}: {type(cause).__name__}: {text}")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def is_checkpoint_name(name: str) -> bool:
    return _NAME.match(name) is not None


def read_json(path: Path) -> dict:
    """A small JSON file of a checkpoint (``{}`` when it is missing or unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints under ``directory`` (those with a manifest), oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name)) and (p / MANIFEST).is_file()
    ]
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
