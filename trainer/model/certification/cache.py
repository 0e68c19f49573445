"""The replica stage's cache: ``$PACKFSDP_CACHE/verdicts/<key>.json``, trusted only when it verifies.

The replica stage (``trainer.model.certification.replica``) runs a tiny replica of the config for seconds, so
its verdict is kept. Since a cached ``exact`` lets a run train without judging its config again, an entry is
used only when it proves it is the verdict of this very key:

- the key is everything the verdict depends on (``verdict_key``): the config, the replica's version and the
  source of the model package that judges it (``trainer/model/**/*.py``: the replica, the packed path, the
  backends), the installed torch, transformers and the kernel libraries transformers may pick;
- the entry records that key in full (the file name is its hash, so a copy under another name is caught),
  an outcome packfsdp writes (``exact``, ``wrong``, ``refused``, ``unbuildable``) with its one line (the
  figures, the refusal, or why no replica runs) and the SHA-256 of them all;
- it is a regular file (not a link).

Anything else (truncated, edited, forged, written for another key or by an older packfsdp) is judged again
with one warning naming the file, and rewritten. A cache that cannot be written only costs the next run
the seconds of judging again (a warning, never a failure).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

OUTCOMES = ("exact", "wrong", "refused", "unbuildable")
"""The replica stage's outcomes (``certification.Stage``), the only ones an entry may hold."""
LIBRARIES = ("torch", "transformers", "flash-attn", "flash-linear-attention", "causal-conv1d", "mamba-ssm", "kernels")
"""Installed versions in the key: the replica runs their code (transformers may dispatch to the kernels)."""


@functools.cache
def _code_digest() -> str:
    """SHA-256 of the model package's source: a change to how verdicts are judged is a new key."""
    h = hashlib.sha256()
    package = Path(__file__).parents[1]
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def verdict_key(config, version: int) -> dict:
    """Everything the verdict of ``config`` depends on (see the module doc)."""
    unkeyed = ("transformers_version", "_name_or_path", "architectures")
    values = {k: v for k, v in config.to_dict().items() if k not in unkeyed}
    return {
        "verdict_version": version,
        "code": _code_digest(),
        "python": list(sys.version_info[:2]),
        "libraries": {name: _installed(name) for name in LIBRARIES},
        "config": json.loads(json.dumps(values, sort_keys=True, default=str)),
    }


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def cache_file(key: dict) -> Path | None:
    """Where the verdict of ``key`` is kept (``None``: ``PACKFSDP_CACHE`` unset, nothing is cached)."""
    root = os.environ.get("PACKFSDP_CACHE")
    if not root:
        return None
    return Path(root).expanduser() / "verdicts" / f"{hashlib.sha256(_canonical(key)).hexdigest()[:24]}.json"


def _checksum(key: dict, outcome: str, line: str) -> str:
    return hashlib.sha256(_canonical({"key": key, "outcome": outcome, "line": line})).hexdigest()


def read_verdict(path: Path | None, key: dict) -> tuple[str, str] | None:
    """The cached ``(outcome, line)`` of ``key`` when ``path`` holds one that verifies; ``None`` (judge it)
    when there is none, or, with a warning naming the file, when it does not verify."""
    if path is None or not (path.exists() or path.is_symlink()):
        return None
    try:
        entry = None if path.is_symlink() or not path.is_file() else json.loads(path.read_text())
    except (OSError, ValueError) as e:
        problem = f"is unreadable ({type(e).__name__})"
    else:
        problem = "is not a regular file" if entry is None else _problem(entry, key)
    if problem is None:
        return entry["outcome"], entry["line"]
    log.warning("replica verdict cache %s %s: judging the config again", path, problem)
    return None


def _problem(entry, key: dict) -> str | None:
    """Why ``entry`` cannot be trusted as the verdict of ``key``, or ``None``."""
    if not isinstance(entry, dict) or not {"key", "outcome", "line", "sha256"} <= set(entry):
        return "is not an entry packfsdp wrote"
    outcome, line = entry["outcome"], entry["line"]
    if outcome not in OUTCOMES or not isinstance(line, str) or not line:
        return f"holds an outcome packfsdp never writes ({str(outcome)[:40]!r})"
    if entry["key"] != key:
        return "was written for another config or other versions"
    if entry["sha256"] != _checksum(key, outcome, line):
        return "does not match its checksum (edited or damaged)"
    return None


def write_verdict(path: Path | None, key: dict, outcome: str, line: str) -> None:
    """Keep the verdict of ``key`` (atomic: a reader sees the old entry or the new one, whole)."""
    if path is None:
        return
    entry = {"key": key, "outcome": outcome, "line": line, "sha256": _checksum(key, outcome, line)}
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, path)  # replaces a link itself, never writes through it
    except OSError as e:
        log.warning(
            "replica verdict cache %s not written (%s): the next run judges the config again", path, e.strerror or e
        )
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
