"""The manifest: size and SHA-256 of every file of a checkpoint, written last, checked before loading
(DCP carries no checksums of its own and would load a flipped byte silently)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from trainer.checkpoint.discovery import FORMAT_VERSION, MANIFEST, TRAINER_STATE, CheckpointError
from trainer.checkpoint.safe_load import SafeFileSystemReader


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
        raise CheckpointError(
            f"{directory}: unreadable {MANIFEST} ({e}); the checkpoint is incomplete or damaged"
        ) from e
    _check_complete(directory, files)
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


def _check_complete(directory: Path, files: dict) -> None:
    """The manifest lists every file loading reads: DCP's ``.metadata``, each data file it names (every byte
    range inside the size the manifest records), the trainer state and every rank's RNG file; an empty or
    edited manifest would otherwise "verify" anything."""
    for rel in (".metadata", TRAINER_STATE):
        if rel not in files:
            raise CheckpointError(
                f"{directory}: the manifest does not list {rel}; the checkpoint is incomplete or damaged"
            )
    _check_listed(directory, files, ".metadata")
    try:
        metadata = SafeFileSystemReader(str(directory)).read_metadata()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- a damaged pickle raises anything; one line naming the file
        raise CheckpointError(f"{directory}: unreadable DCP .metadata ({type(e).__name__}: {e})") from None
    for info in (metadata.storage_data or {}).values():
        rel = str(info.relative_path)
        if rel not in files:
            raise CheckpointError(f"{directory}: the manifest does not list {rel}, which the DCP metadata needs")
        if info.offset + info.length > files[rel]["bytes"]:
            raise CheckpointError(f"{directory}: {rel} is shorter than the DCP metadata says")
    try:
        world_size = int(json.loads((directory / TRAINER_STATE).read_text()).get("world_size", 1))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{directory}: unreadable {TRAINER_STATE} ({e})") from None
    for rank in range(world_size):
        rel = f"rng/rank_{rank:05d}.safetensors"
        if rel not in files:
            raise CheckpointError(f"{directory}: the manifest does not list {rel} (rank {rank}'s RNG state)")


def _check_listed(directory: Path, files: dict, rel: str) -> None:
    """One listed file is exactly as the manifest records it (checked before it is parsed)."""
    path = directory / rel
    if not path.is_file() or path.stat().st_size != files[rel]["bytes"] or sha256_file(path) != files[rel]["sha256"]:
        raise CheckpointError(f"{directory}: file {rel} is missing or does not match the manifest")


def sizes_match(directory: str | Path) -> bool:
    """A cheap check (no hashing): the manifest is readable and every file it lists has its recorded size."""
    directory = Path(directory)
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
        return bool(files) and all((directory / rel).stat().st_size == e["bytes"] for rel, e in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def file_stamps(directory: str | Path) -> tuple:
    """Size and modification time of every file of a checkpoint: unchanged stamps mean a verification
    done moments ago still holds (so ``resume=auto`` does not hash the checkpoint it picked twice)."""
    directory = Path(directory)
    return tuple(
        (str(p.relative_to(directory)), p.stat().st_size, p.stat().st_mtime_ns) for p in _payload_files(directory)
    )


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
