"""The cache sink: a source's parts rendered once into memory-mapped arrays (``trainer.data.arrays``).

``build_dataset`` is the entry point: ``cache_folder`` names the folder from everything the examples depend
on, ``build_cache`` writes it once (rank 0, into a temporary folder renamed into place), ``open_cache`` maps
it on every rank. A part (``trainer.data.parts``) is written one of two ways, both through the one renderer
(``trainer.data.render``):

- a table (``jsonl``, ``csv`` and ``parquet`` files, ``hf`` datasets, a plugin source returning a
  ``datasets.Dataset``): rendered by ``render_batch`` inside a batched, multi-process ``datasets.map``
  (``data.num_proc``; its output is cached by a fingerprint of the input and of what rendering depends on),
  then the flat arrays are copied out of the Arrow list columns batch by batch (``pyarrow`` buffers, never
  Python lists of every record);
- records (every other source, and a file ``datasets`` refuses, read by the line reader):
  ``render_outcomes`` in chunks of ``RECORDS_CHUNK``.

Both keep today's rules: a bad row is an error naming its file and line (a ``map`` worker raises it with
the place) or, under ``data.on_bad_record=skip``, a counted skip logged with its place; skips, truncations
and empty examples land in ``DatasetStats``. A JSON Lines file ``datasets`` refuses (a malformed line fails
the whole file there) is read again by the line reader, which names the line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from trainer.config import DataConfig
from trainer.data.arrays import ArrayWriter, open_arrays
from trainer.data.bad_records import BadRecordError, BadRecords
from trainer.data.cache_integrity import build_errors, build_lock, seal, verified
from trainer.data.examples import TokenizedDataset
from trainer.data.parts import Places, is_table, source_parts
from trainer.data.render import RENDER_VERSION, Outcome, RowProblems, render_batch, render_outcomes, stats_of
from trainer.data.tables import mapped_columns_only, rows_to_records
from trainer.distributed import on_rank0_then_all

log = logging.getLogger(__name__)

RECORDS_CHUNK = 4096
"""Records rendered at a time on the records path."""
MAP_BATCH = 1000
"""Rows per batch of the ``map`` (one batched tokenizer call each)."""
SINGLE_PROCESS_BELOW = 20_000
"""Smaller inputs are mapped in-process: starting workers costs more than it saves."""


def build_dataset(
    tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, max_length: int, cache_key: str
) -> TokenizedDataset:
    """Tokenize once (rank 0) into the cache, then every rank memory-maps the same arrays.

    ``cache_key`` must name everything the result depends on besides ``max_length`` (the config, the
    source's files, the tokenizer); the sources are read only when the cache misses.
    """
    key = json.dumps([RENDER_VERSION, cache_key, max_length], sort_keys=True, default=str)
    folder = cache_folder(cfg, key)
    on_rank0_then_all(lambda: build_cache(folder, cfg, tokenizer, max_length, key))
    return open_cache(folder, cfg)


def cache_folder(cfg: DataConfig, key: str) -> Path:
    """The cache folder of the examples ``key`` names."""
    return Path(cfg.cache_dir).expanduser() / "datasets" / hashlib.sha256(key.encode()).hexdigest()[:20]


def build_cache(folder: Path, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, max_length: int, key: str) -> None:
    """Write ``folder`` unless it is complete and verifies (``trainer.data.cache_integrity``): the source
    rendered into a temporary folder, sealed with its checksums, renamed into place (atomic: a half-written
    cache is never picked up). Two jobs building one cache are serialised: the second waits and reuses it."""
    with build_lock(folder):
        if verified(folder, max_length):
            log.info("data %s: tokenized dataset read from the cache %s", cfg.source, folder)
            return
        log.info("data %s: tokenizing once into %s", cfg.source, folder)
        tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with build_errors(tmp):
                writer = ArrayWriter(tmp)
                write_source(cfg, tokenizer, max_length, writer, key)
                writer.finish()
                seal(tmp)
        except BaseException:  # a bad record (or an interrupt) leaves no half-written folder behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)


def open_cache(folder: Path, cfg: DataConfig) -> TokenizedDataset:
    """The complete cache ``folder``, memory-mapped; a source that left no usable example is an error."""
    ds = open_arrays(folder)
    if len(ds) == 0:
        s = ds.stats
        raise BadRecordError(
            f"data.source={cfg.source}: no usable example ({s.records} records read; left out: {s.left_out()})"
        )
    return ds


def write_source(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, max_length: int, writer: ArrayWriter, key: str
) -> None:
    """Every part of the source rendered into ``writer`` (``data.limit`` records at most)."""
    bad = BadRecords(cfg.on_bad_record, cfg.source)
    left = cfg.limit
    for part in source_parts(cfg, bad):
        if left is not None and left <= 0:
            break
        if (opened := part.open()) is None:  # an empty file (reported to ``bad``)
            continue
        if is_table(opened):
            n = write_arrow(opened, part.places, cfg, tokenizer, max_length, writer, bad, left, key)
        else:
            n = write_records(opened, cfg, tokenizer, max_length, writer, bad, left)
        left = None if left is None else left - n
    bad.finish([])
    writer.stats.dropped_bad = bad.skipped


def write_records(
    records: list,
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    writer: ArrayWriter,
    bad: BadRecords,
    limit: int | None,
) -> int:
    """Records rendered ``RECORDS_CHUNK`` at a time; the number of records used."""
    bad.skipped += getattr(records, "skipped_bad", 0)  # a source's own skips stay counted
    n = len(records) if limit is None else min(limit, len(records))
    for lo in range(0, n, RECORDS_CHUNK):
        rendered = render_outcomes(records[lo : min(n, lo + RECORDS_CHUNK)], tokenizer, cfg, max_length, bad)
        writer.count(stats_of(np.array([outcome for _, _, outcome, _ in rendered], dtype=np.int8)))
        writer.add_examples(
            [(ids, mask, split) for ids, mask, outcome, split in rendered if outcome <= Outcome.TRUNCATED]
        )
    return n


def write_arrow(
    ds,
    places: Places,
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    writer: ArrayWriter,
    bad: BadRecords,
    limit: int | None,
    key: str,
) -> int:
    """One table part rendered by a ``map`` and copied into ``writer``; the number of rows used."""
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
    mapped = map_render(ds, places, cfg, tokenizer, max_length, key)
    start = 0
    for batch in mapped.data.table.to_batches(max_chunksize=65536):
        status = batch.column("status").to_numpy()
        ids, mask = batch.column("input_ids"), batch.column("loss_mask")
        lengths = ids.value_lengths().to_numpy(zero_copy_only=False)
        kept = status <= Outcome.TRUNCATED
        writer.add(
            ids.flatten().to_numpy(),
            mask.flatten().to_numpy(zero_copy_only=False),
            lengths[kept],
            batch.column("pair_split").to_numpy()[kept],
        )
        writer.count(stats_of(status))
        reasons = batch.column("reason")
        for i in np.flatnonzero(status == Outcome.BAD):  # skipped (an error was raised in the worker)
            bad.bad(places.lazy(start + int(i)), reasons[int(i)].as_py())
        for i in np.flatnonzero(status == Outcome.OVERSIZE):
            bad.oversize(places.lazy(start + int(i)), reasons[int(i)].as_py())
        start += len(batch)
    for f in mapped.cache_files:  # the arrays now hold it all; the map's Arrow copy would double the disk
        Path(f["filename"]).unlink(missing_ok=True)
    return len(ds)


def map_render(ds, places: Places, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, max_length: int, key: str):
    """``ds`` rendered by a batched ``map`` over ``data.num_proc`` processes (its output cached by a
    fingerprint of ``ds`` and ``key``, everything rendering depends on)."""
    ds = mapped_columns_only(ds, cfg)
    if len(ds):  # an undetectable or missing column mapping fails here, once, with the config's message
        rows_to_records([ds[0]], cfg, RowProblems("skip", places))
    procs = (
        1 if len(ds) < SINGLE_PROCESS_BELOW else max(1, min(cfg.num_proc or default_num_proc(), len(ds) // MAP_BATCH))
    )
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("bool")),
            "status": datasets.Value("int8"),
            "reason": datasets.Value("string"),
            "pair_split": datasets.Value("int64"),
        }
    )
    fingerprint = hashlib.sha256(f"{ds._fingerprint}|{key}".encode()).hexdigest()[:32]
    return ds.map(
        render_batch,
        batched=True,
        batch_size=MAP_BATCH,
        with_indices=True,
        num_proc=procs if procs > 1 else None,
        remove_columns=ds.column_names,
        features=features,
        new_fingerprint=fingerprint,
        fn_kwargs={"tokenizer": tokenizer, "cfg": cfg, "max_length": max_length, "places": places},
        desc=f"packfsdp: rendering {cfg.source}",
    )


def default_num_proc() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


__all__ = ["build_cache", "build_dataset", "cache_folder", "default_num_proc", "open_cache", "write_source"]
