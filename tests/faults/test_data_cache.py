"""Issue 24: the tokenized cache is verified when opened (checksums and the arrays' consistency); a
tampered, truncated or broken one is rebuilt, never trained on; two jobs building one cache are serialised."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest

from trainer.data.arrays import ArrayWriter, open_arrays
from trainer.data.cache_integrity import CacheDamaged, build_lock, check_cache, load_hashes, save_hashes, seal


def built(folder, n=50, max_length=16):
    rng = np.random.default_rng(0)
    writer = ArrayWriter(folder)
    lengths = rng.integers(2, max_length, n)
    tokens = rng.integers(0, 100, lengths.sum()).astype(np.int32)
    writer.add(tokens, rng.random(lengths.sum()) < 0.7, lengths)
    writer.finish()
    seal(folder)
    return folder


def overwrite_npy(path, values):
    arr = np.load(path)
    arr[: len(values)] = values
    np.save(path, arr)


TAMPERING = {
    "token ids overwritten": lambda f: overwrite_npy(f / "tokens.npy", [7] * 20),
    "half the mask zeroed": lambda f: overwrite_npy(f / "loss_mask.npy", [False] * 200),
    "lengths vs offsets": lambda f: overwrite_npy(f / "lengths.npy", [300]),
    "truncated tokens": lambda f: (f / "tokens.npy").write_bytes((f / "tokens.npy").read_bytes()[:-40]),
    "random bytes": lambda f: (f / "offsets.npy").write_bytes(np.random.default_rng(1).bytes(300)),
    "broken stats": lambda f: (f / "stats.json").write_text("{not json"),
    "no checksums (an old or half-copied cache)": lambda f: (f / "checksums.json").unlink(),
}


@pytest.mark.parametrize("how", TAMPERING)
def test_a_tampered_cache_does_not_verify(tmp_path, how):
    folder = built(tmp_path / "cache")
    check_cache(folder, max_length=16)
    TAMPERING[how](folder)
    with pytest.raises(CacheDamaged):
        check_cache(folder, max_length=16)


def test_consistency_is_checked_even_when_the_checksums_were_rewritten(tmp_path):
    folder = built(tmp_path / "cache")
    overwrite_npy(folder / "lengths.npy", [300])  # an array of 126k-token examples against max_length 16
    seal(folder)
    with pytest.raises(CacheDamaged, match="offsets.npy and lengths.npy disagree"):
        check_cache(folder, max_length=16)


def test_tampered_held_out_hashes_are_computed_again(tmp_path):
    ds = open_arrays(built(tmp_path / "cache"))
    first = ds.content_hashes(0).copy()
    path = tmp_path / "cache" / "content_hashes_0.npy"
    assert (load_hashes(path) == first).all()
    np.save(path, np.zeros_like(first))  # replaced: the held-out split would change silently
    assert load_hashes(path) is None
    assert (open_arrays(tmp_path / "cache").content_hashes(0) == first).all()
    save_hashes(path, first)
    assert (load_hashes(path) == first).all()


def _hold(folder, started):
    with build_lock(folder):
        started.set()
        time.sleep(0.5)
        (folder.parent / "built").write_text("by the first job")


def test_two_builds_of_one_cache_are_serialised(tmp_path):
    ctx = multiprocessing.get_context("fork")
    started = ctx.Event()
    holder = ctx.Process(target=_hold, args=(tmp_path / "cache", started))
    holder.start()
    try:
        assert started.wait(30)
        with build_lock(tmp_path / "cache"):  # waits for the first job, then finds its result
            assert (tmp_path / "built").read_text() == "by the first job"
        holder.join(30)
        assert holder.exitcode == 0
    finally:
        holder.kill()


def test_a_full_disk_during_the_build_names_the_cache_folder(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from trainer.data.cache_integrity import CacheBuildError, build_errors

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 4096))
    with pytest.raises(
        CacheBuildError, match=rf"building the data cache in {tmp_path / 'c'} failed: no space left on device"
    ):
        with build_errors(tmp_path / "c"):
            raise OSError("514943 requested and 111048 written")  # numpy's tofile on a full disk
    with pytest.raises(FileNotFoundError):  # a missing source file keeps its own error
        with build_errors(tmp_path / "c"):
            open(tmp_path / "missing.jsonl")


def test_escape_codes_from_data_never_reach_the_terminal():
    from trainer.config import ConfigError
    from trainer.guard import describe_failure

    failure = describe_failure(ConfigError("data.jsonl:3: unknown chat role '\x1b[2J\x1b[31mhacked'"), "setup", 10)
    assert "\x1b" not in str(failure) and "\\x1b[2J" in str(failure)
