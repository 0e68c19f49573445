"""The manifest: size and SHA-256 of every file of a checkpoint, written last, checked before loading
(DCP carries no checksums of its own and would load a flipped byte silently)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from trainer.checkpoint.discovery import FORMAT_VERSION, MANIFEST, CheckpointError


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _payload_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path, step: int) -> None:
    files = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in _payload_files(directory)
    }
    manifest = {"format": FORMAT_VERSION, "step": step, "files": files, "created": time.time()}
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)


def verify_checkpoint(directory: str | Path) -> dict:
    """Check every file of a checkpoint against its manifest; raise ``CheckpointError`` naming the first
    file that is missing, truncated, grown or changed. Returns the manifest."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{directory}: unreadable {MANIFEST} ({e}); the checkpoint is incomplete or damaged")
    for rel, expected in files.items():
        path = directory / rel
        if not path.is_file():
            raise CheckpointError(f"{directory}: file {rel} listed in the manifest is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"{directory}: file {rel} has {size} bytes, the manifest says {expected['bytes']} (truncated or "
                "partially copied); use an earlier checkpoint"
            )
        if sha256_file(path) != expected["sha256"]:
            raise CheckpointError(
                f"{directory}: file {rel} does not match its SHA-256 in the manifest (corrupted on disk or in "
                "transfer); use an earlier checkpoint"
            )
    # Files the manifest does not list (an editor's backup, a copy tool's marker) are never read: ignored.
    return manifest


def file_stamps(directory: str | Path) -> tuple:
    """Size and modification time of every file of a checkpoint: unchanged stamps mean a verification
    done moments ago still holds (so ``resume=auto`` does not hash the checkpoint it picked twice)."""
    directory = Path(directory)
    return tuple((str(p.relative_to(directory)), p.stat().st_size, p.stat().st_mtime_ns) for p in _payload_files(directory))


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
