"""The tokenized cache is verified when opened, and built by one job at a time.

- ``seal`` (after a build): ``checksums.json`` records the size and CRC-32 of every file the build wrote
  (the arrays and ``stats.json``). A held-out hash file written later gets its own ``<file>.crc32``.
- ``check_cache`` (rank 0, before every rank maps the arrays): every recorded file has its size and CRC-32,
  and the arrays agree with each other and with ``stats.json`` (``offsets`` starts at 0 and steps by
  ``lengths``, ends at the token count, every length within ``max_length``, ``label_counts`` sums to what the
  mask gives, the stats' counts are the arrays'). A cache that fails is rebuilt (``build_dataset``), with a
  warning naming the folder and the first mismatch; nothing tampered, truncated or half-copied is trained on.
- While a run reads it (``stamps`` when opened, ``check_unchanged`` after each step's batches and each
  eval are read): the memory-mapped files (``MAPPED``; the other arrays are copied into memory at open)
  keep the device, inode, size, modification and change times they had when opened. ``st_ctime`` moves
  on any write and ``os.utime`` cannot set it back, so a file rewritten in place or replaced stops the run
  with one line (``CacheChanged``) before a step trains on what it read; two ``stat`` calls per folder
  and step (cost in ``docs/data.md``).
- The local tokenizer (``trainer.data.tokenizer``) is sealed the same way (``seal_folder``: every file its
  ``save_pretrained`` wrote) and used only when ``intact``; anything else is trained again.
- ``build_lock``: an exclusive ``flock`` on ``<cache_dir>/locks/<kind>-<folder>.lock``, so two jobs building
  one cache at once are serialised: the second waits, then finds the cache the first sealed and reuses it.

CRC-32 (zlib) reads the files at memory speed; the cost at 1M examples is in ``docs/data.md``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from trainer.data.bad_records import BadRecordError

log = logging.getLogger(__name__)

CHECKSUMS = "checksums.json"
SEALED = (
    "tokens.npy",
    "loss_mask.npy",
    "offsets.npy",
    "lengths.npy",
    "label_counts.npy",
    "pair_splits.npy",
    "stats.json",
)
"""What a build writes, in ``checksums.json``."""


MAPPED = ("tokens.npy", "loss_mask.npy")
"""The files a run keeps reading after it opened the cache (memory-mapped, ``trainer.data.arrays``)."""


class CacheDamaged(ValueError):
    """A cache folder does not match what its build wrote."""


class CacheChanged(BadRecordError):
    """A cache file a run maps changed while the run read it (exit code 2; a new start verifies and rebuilds it)."""


def crc32_file(path: Path, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def _record(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "crc32": crc32_file(path)}


def seal(folder: Path) -> None:
    """Record the checksums of a finished build (before it is renamed into place)."""
    (folder / CHECKSUMS).write_text(json.dumps({name: _record(folder / name) for name in SEALED}))


def check_files(folder: Path, recorded: dict) -> None:
    for name, expected in recorded.items():
        path = folder / name
        if not path.is_file() or path.is_symlink():
            raise CacheDamaged(f"{name} is missing")
        if path.stat().st_size != expected["bytes"]:
            raise CacheDamaged(f"{name} has {path.stat().st_size} bytes, its build wrote {expected['bytes']}")
        if crc32_file(path) != expected["crc32"]:
            raise CacheDamaged(f"{name} does not match the checksum its build recorded")


def seal_folder(folder: Path) -> None:
    """``checksums.json`` for every file of a cache folder whose file names a library picks (the local
    tokenizer's ``save_pretrained``)."""
    (folder / CHECKSUMS).write_text(json.dumps({p.name: _record(p) for p in sorted(folder.iterdir()) if p.is_file()}))


def intact(folder: Path, what: str) -> bool:
    """Whether ``folder`` holds exactly the files its ``seal_folder`` recorded, each as written. One that does
    not (damaged, edited, a file added that a loader would read, sealed by no packfsdp) is logged, and then
    built again."""
    if not folder.is_dir():
        return False
    try:
        recorded = json.loads((folder / CHECKSUMS).read_text())
        if not isinstance(recorded, dict) or not recorded:
            raise CacheDamaged(f"{CHECKSUMS} lists no file")
        extra = sorted({p.name for p in folder.iterdir()} - set(recorded) - {CHECKSUMS})
        if extra:
            raise CacheDamaged(f"it holds files its build did not write ({', '.join(extra[:4])})")
        check_files(folder, recorded)
    except (OSError, ValueError, KeyError, TypeError) as e:  # CacheDamaged is a ValueError
        log.warning(
            "the %s cache %s does not verify (%s): building it again",
            what,
            folder,
            e if isinstance(e, CacheDamaged) else f"{CHECKSUMS} is missing or unreadable: {type(e).__name__}",
        )
        return False
    return True


def check_cache(folder: Path, max_length: int) -> None:
    """Raise ``CacheDamaged`` naming the first mismatch (see the module doc)."""
    try:
        recorded = json.loads((folder / CHECKSUMS).read_text())
    except (OSError, ValueError) as e:
        raise CacheDamaged(f"{CHECKSUMS} is missing or unreadable ({type(e).__name__})") from None
    if set(recorded) != set(SEALED):
        raise CacheDamaged(f"{CHECKSUMS} does not list the files of a build")
    check_files(folder, recorded)
    check_consistent(folder, max_length)


def check_consistent(folder: Path, max_length: int) -> None:
    """The arrays agree with each other and with ``stats.json`` (catches a build that recorded bad data)."""
    try:
        stats = json.loads((folder / "stats.json").read_text())
        tokens = np.load(folder / "tokens.npy", mmap_mode="r")
        mask = np.load(folder / "loss_mask.npy", mmap_mode="r")
        offsets, lengths = np.load(folder / "offsets.npy"), np.load(folder / "lengths.npy")
        counts = np.load(folder / "label_counts.npy")
        splits = np.load(folder / "pair_splits.npy")
    except (OSError, ValueError) as e:
        raise CacheDamaged(f"an array does not read ({type(e).__name__}: {e})") from None
    n = len(lengths)
    if offsets.dtype != np.int64 or lengths.dtype != np.int64 or mask.dtype != np.bool_ or tokens.dtype != np.int32:
        raise CacheDamaged("an array has the wrong type")
    if len(offsets) != n + 1 or len(counts) != n or offsets[0] != 0 or (np.diff(offsets) != lengths).any():
        raise CacheDamaged("offsets.npy and lengths.npy disagree")
    if len(splits) != n or (splits < 0).any() or (splits >= np.maximum(lengths, 1)).any():
        raise CacheDamaged("pair_splits.npy disagrees with lengths.npy")
    if offsets[-1] != len(tokens) or len(tokens) != len(mask):
        raise CacheDamaged(f"offsets end at {offsets[-1]}, tokens.npy holds {len(tokens)}, loss_mask.npy {len(mask)}")
    if n and (lengths.min() < 1 or lengths.max() > max_length):
        raise CacheDamaged(f"an example of {lengths.max()} tokens, over data.max_length={max_length}")
    starts = offsets[:-1][lengths > 0]
    labelled = int(np.count_nonzero(mask)) - int(np.count_nonzero(mask[starts]))  # a first token never counts
    if int(counts.sum()) != labelled or (counts > lengths - 1).any() or (counts < 0).any():
        raise CacheDamaged("label_counts.npy disagrees with loss_mask.npy")
    if (stats.get("examples"), stats.get("tokens"), stats.get("label_tokens")) != (
        n,
        int(offsets[-1]),
        int(counts.sum()),
    ):
        raise CacheDamaged("stats.json disagrees with the arrays")


def verified(folder: Path, max_length: int) -> bool:
    """Whether a complete cache is there and verifies; a damaged one is logged (it is then rebuilt)."""
    if not (folder / "stats.json").is_file():
        return False
    try:
        check_cache(folder, max_length)
    except CacheDamaged as e:
        log.warning("the data cache %s does not verify (%s): rebuilding it", folder, e)
        return False
    return True


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """One job at a time builds ``folder`` (a ``flock``, released by the kernel if the job dies)."""
    locks = folder.parent.parent / "locks"  # beside the cache kinds: never a stray file among the caches
    locks.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks / f"{folder.parent.name}-{folder.name}.lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("the data cache %s is being built by another job: waiting for it", folder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def load_hashes(path: Path) -> np.ndarray | None:
    """A held-out hash file whose ``.crc32`` matches, or ``None`` (then it is computed again)."""
    try:
        expected = json.loads(path.with_name(path.name + ".crc32").read_text())
        check_files(path.parent, {path.name: expected})
        return np.load(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_hashes(path: Path, hashes: np.ndarray) -> None:
    """Write a held-out hash file and its checksum (atomic: ranks writing at once each write whole files)."""
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
    np.save(tmp, hashes)
    side = path.with_name(f"{path.name}.crc32.{os.getpid()}")
    side.write_text(json.dumps(_record(tmp)))
    os.replace(tmp, path)
    os.replace(side, path.with_name(path.name + ".crc32"))


class CacheBuildError(RuntimeError):
    """Writing the cache failed (a full disk, a lost mount): one line naming the folder."""


@contextlib.contextmanager
def build_errors(folder: Path) -> Iterator[None]:
    """An ``OSError`` while writing ``folder`` as one line naming it; numpy's "N requested and M written"
    (a full disk, without errno) says so."""
    try:
        yield
    except OSError as e:
        text = e.strerror or str(e)
        try:
            free = shutil.disk_usage(folder.parent).free
        except OSError:
            free = None
        full = e.errno in (errno.ENOSPC, errno.EDQUOT) or (
            "requested and" in text and free is not None and free < 2**26
        )
        if not full and not str(e.filename or "").startswith(str(folder)):
            raise  # reading the source (a missing file...): its own error names it
        if full:
            text = f"no space left on device ({free} bytes free; {text})"
        raise CacheBuildError(
            f"building the data cache in {folder} failed: {text}; free space or set data.cache_dir"
        ) from None


def stamps(folder: Path) -> dict[str, list[int]]:
    """The mapped files of ``folder`` as they are now: device, inode, size, modification and change times."""
    return {name: _stamp(folder / name) for name in MAPPED}


def _stamp(path: Path) -> list[int]:
    try:
        st = os.stat(path)
    except OSError:
        return []
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def check_unchanged(folder: Path, opened: dict[str, list[int]]) -> None:
    """Raise ``CacheChanged`` when a mapped file is no longer the one ``stamps`` saw when the cache was opened."""
    for name, then in opened.items():
        now = _stamp(folder / name)
        if now != then:
            how = "was removed" if not now else "was replaced" if now[:2] != then[:2] else "was written to"
            raise CacheChanged(
                f"{folder / name} {how} while this run read it (the data cache must not change under a run); "
                "nothing was trained on what changed: run again with resume=auto (the cache is verified, and "
                "rebuilt, when a run opens it)"
            )
