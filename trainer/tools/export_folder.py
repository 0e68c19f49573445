"""What ``packfsdp export out=DIR`` may replace: a new or empty folder, or with ``overwrite=true`` a previous
export that packfsdp wrote and nobody changed since; never a run directory, a checkpoint or a user's file.

An export ends with ``packfsdp_export.json`` (``write_record``): what it was exported from and the size and
SHA-256 of every file it wrote. ``overwrite=true`` replaces a folder only when that record lists exactly the
files the folder holds, each as written (``check_out``, before any work and again right before the swap);
anything else is refused in one line naming what is not the export's (a folder without a record, a file
added or changed since, a link).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from trainer.checkpoint import CheckpointError
from trainer.checkpoint.manifest import sha256_file

RECORD = "packfsdp_export.json"
"""The export's own marker, written last into the folder."""


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse (``CheckpointError``, one line) an ``out`` the export may not write (see the module doc)."""
    if out.is_symlink():
        raise CheckpointError(f"out={out} is a symlink; packfsdp never writes through a link: give a folder")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not overwrite:
        raise CheckpointError(
            f"out={out} is not empty; packfsdp never overwrites files it did not write: give a new folder, "
            "or add overwrite=true to replace an earlier export"
        )
    if (problem := not_an_export(out)) is not None:
        raise CheckpointError(
            f"out={out} {problem}; overwrite=true replaces only an earlier export packfsdp wrote and nobody "
            "changed since: give a new folder, or move it away yourself"
        )


def not_an_export(folder: Path) -> str | None:
    """Why ``folder`` is not an untouched export packfsdp wrote, or ``None``."""
    if not folder.is_dir():
        return "is a file, not an export"
    record_file = folder / RECORD
    try:
        listed = json.loads(record_file.read_text())["files"] if not record_file.is_symlink() else None
    except (OSError, ValueError, KeyError, TypeError):
        listed = None
    if not isinstance(listed, dict):
        return f"is not an export packfsdp wrote (no {RECORD} listing its files)"
    found = {str(p.relative_to(folder)): p for p in folder.rglob("*") if p.is_symlink() or not p.is_dir()}
    found.pop(RECORD)
    foreign = sorted(set(found) - set(listed))
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        return f"holds files the export did not write ({shown})"
    for rel, expected in sorted(listed.items()):
        path = found.get(rel)
        if path is None or path.is_symlink() or not isinstance(expected, dict):
            return f"is missing {rel}, or it is not the file the export wrote"
        if path.stat().st_size != expected.get("bytes") or sha256_file(path) != expected.get("sha256"):
            return f"holds {rel} changed since the export wrote it"
    return None


def write_record(folder: Path, info: dict) -> None:
    """``packfsdp_export.json``: ``info`` and the size and SHA-256 of every file in ``folder`` (written last)."""
    files = {
        str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
    (folder / RECORD).write_text(json.dumps({"writer": "packfsdp", **info, "files": files}, indent=1))


def replace(final: Path, written: Path, overwrite: bool) -> None:
    """Move the finished export ``written`` into place at ``final``; what ``final`` held is checked again
    (it may have changed while the export ran) and goes as a whole."""
    try:
        check_out(final, overwrite)
    except CheckpointError:
        shutil.rmtree(written, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        shutil.rmtree(old)
    os.replace(written, final)
