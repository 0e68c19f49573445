"""Sources as ``datasets`` tables, and the ``map`` that renders them (the Arrow path of ``trainer.data.engine``).

``source_parts`` splits a source into parts: a ``datasets.Dataset`` per local JSON Lines, CSV or Parquet file (so
every row knows its file), the ``hf`` source's dataset, a plugin's ``datasets.Dataset``, or a list of
records for everything else. ``map_render`` renders a part with ``trainer.data.dataset.render_outcomes``
inside a batched ``map``: one output row per input row with its tokens, mask, ``Outcome`` and, for a
skipped bad row, the reason.
"""

from __future__ import annotations

import csv
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from transformers import PreTrainedTokenizerBase

from trainer.config import DataConfig
from trainer.data.bad_records import BadRecords, check_not_empty
from trainer.data.dataset import Outcome, render_outcomes
from trainer.data.sources import check_source, open_hf_dataset
from trainer.data.tables import (
    Row, mapped_columns_only, read_csv, read_jsonl, read_parquet, rows_to_records, table_files,
)
from trainer.library_errors import library_load

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Places:
    """How row ``i`` of a part is named for the user: ``file:line`` of a JSON Lines or CSV file (the line the
    row ends on, as the line readers say), else ``NAME row i``."""

    name: str
    lines: str = ""
    """``json`` or ``csv``: the part is that file, whose rows are named by line."""

    def where(self, index: int) -> str:
        find_line = {"json": _json_line, "csv": _csv_line}.get(self.lines)
        line = find_line(self.name, index) if find_line else None
        return f"{self.name}:{line}" if line is not None else f"{self.name} row {index}"

    def lazy(self, index: int) -> _LazyPlace:
        return _LazyPlace(self, index)


def _json_line(file: str, index: int) -> int | None:
    """The line of the ``index``-th non-blank line (``datasets`` skips blank ones)."""
    with open(file, "rb") as f:
        rows = -1
        for n, line in enumerate(f, 1):
            rows += bool(line.strip())
            if rows == index:
                return n
    return None


def _csv_line(file: str, index: int) -> int | None:
    """The line the ``index``-th data row ends on (a quoted cell may span lines; blank lines hold no row)."""
    with open(file, newline="", encoding="utf-8-sig", errors="replace") as f:
        reader = csv.reader(f)
        rows = -1  # the header row
        for row in reader:
            rows += bool(row)
            if rows == index + 1:
                return reader.line_num
    return None


class _LazyPlace(str):
    """A place computed only when shown (a skip past the first few logged is only counted)."""

    def __new__(cls, places: Places, index: int) -> _LazyPlace:
        obj = super().__new__(cls, f"#{index}")
        obj.places, obj.index = places, index
        return obj

    def __str__(self) -> str:
        return self.places.where(self.index)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


@dataclass
class ArrowPart:
    dataset: object
    """A ``datasets.Dataset``."""
    places: Places


def source_parts(cfg: DataConfig, bad: BadRecords) -> Iterator[ArrowPart | list]:
    """The source as parts, in order. A file ``datasets`` cannot read goes to the line reader (which names
    the bad line, or skips it) and comes back as records."""
    readers = {"jsonl": ("json", (".jsonl", ".json"), read_jsonl), "parquet": ("parquet", (".parquet",), read_parquet),
               "csv": ("csv", (".csv",), read_csv)}
    if cfg.source in readers:
        builder, suffixes, reader = readers[cfg.source]
        for file in table_files(cfg, suffixes):
            ds = _load_file(builder, file, cfg)
            if ds is None:
                yield rows_to_records(reader([file], bad), cfg, bad)
                continue
            check_not_empty(file, len(ds), bad)
            if len(ds):
                yield ArrowPart(ds, Places(str(file), lines=builder if builder in ("json", "csv") else ""))
        return
    if cfg.source == "hf":
        with library_load(f"data.path={cfg.path}"):
            yield ArrowPart(open_hf_dataset(cfg), Places(f"data.path={cfg.path}"))
        return
    result = check_source(cfg)(cfg)
    if _is_dataset(result):
        yield ArrowPart(result, Places(f"data.source={cfg.source}"))
    else:
        yield result if isinstance(result, list) else list(result)


def _is_dataset(value: object) -> bool:
    import datasets

    return isinstance(value, datasets.Dataset)


def reader_options(builder: str, file: Path) -> dict:
    """``load_dataset`` options of a file builder: CSV cells stay strings, an empty one "", as Python's csv
    module reads them (pandas would infer numbers and NaN): every column of the header typed ``string``."""
    if builder != "csv":
        return {}
    import csv

    import datasets

    with open(file, newline="", encoding="utf-8-sig", errors="replace") as f:
        header = next(csv.reader(f), [])
    features = datasets.Features({name: datasets.Value("string") for name in header}) if header else None
    return {"features": features, "keep_default_na": False, "na_filter": False}


def _load_file(builder: str, file: Path, cfg: DataConfig):
    """``file`` read by ``datasets`` into Arrow (cached under ``data.cache_dir``), or ``None`` if it refuses it."""
    import datasets

    try:
        return datasets.load_dataset(builder, data_files=str(file), split="train",
                                     cache_dir=str(Path(cfg.cache_dir).expanduser() / "hf"), **reader_options(builder, file))
    except Exception as e:  # noqa: BLE001 - any parse failure: the line reader names the place or skips it
        log.info("data %s: %s not read by datasets (%s); reading it line by line", cfg.source, file, str(e)[:200])
        return None


class RowProblems(BadRecords):
    """Bad rows inside a ``map`` worker, named ``#index``: under ``error`` raised with the row's place, under
    ``skip`` kept by index for the output's ``reason`` column (the main process counts and logs them)."""

    def __init__(self, mode: str, places: Places) -> None:
        super().__init__(mode)
        self.places = places
        self.reasons: dict[int, str] = {}

    def bad(self, where: str, reason: str, kind: str = "record") -> None:
        index = int(str.__str__(where).removeprefix("#"))
        if self.mode == "error":
            super().bad(self.places.where(index), reason, kind)
        self.reasons[index] = reason


def render_batch(batch: dict[str, list], indices: list[int], *, tokenizer: PreTrainedTokenizerBase,
                 cfg: DataConfig, max_length: int, places: Places) -> dict[str, list]:
    """The ``map`` function: a batch of rows -> one output row each (tokens, mask, outcome, reason)."""
    rows = []
    for k, index in enumerate(indices):
        row = Row({name: values[k] for name, values in batch.items()})
        row.where = f"#{index}"
        rows.append(row)
    problems = RowProblems(cfg.on_bad_record, places)
    records = rows_to_records(rows, cfg, problems)
    rendered = render_outcomes(records, tokenizer, cfg, max_length, problems)
    position = {index: k for k, index in enumerate(indices)}
    out = {"input_ids": [[] for _ in indices], "loss_mask": [[] for _ in indices],
           "status": [int(Outcome.BAD)] * len(indices), "reason": [""] * len(indices)}
    for record, (ids, mask, outcome) in zip(records, rendered):
        k = position[int(record.where[1:])]
        out["input_ids"][k], out["loss_mask"][k], out["status"][k] = ids, mask, int(outcome)
    for index, reason in problems.reasons.items():
        out["reason"][position[index]] = reason
    return out


def map_render(ds, places: Places, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, max_length: int, key: str):
    """``ds`` rendered by a batched ``map`` over ``data.num_proc`` processes (its output cached by a
    fingerprint of ``ds`` and ``key``, everything rendering depends on)."""
    import datasets

    from trainer.data.engine import MAP_BATCH, SINGLE_PROCESS_BELOW, default_num_proc

    ds = mapped_columns_only(ds, cfg)
    if len(ds):  # an undetectable or missing column mapping fails here, once, with the config's message
        rows_to_records([ds[0]], cfg, RowProblems("skip", places))
    procs = 1 if len(ds) < SINGLE_PROCESS_BELOW else max(1, min(cfg.num_proc or default_num_proc(), len(ds) // MAP_BATCH))
    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")), "loss_mask": datasets.Sequence(datasets.Value("bool")),
        "status": datasets.Value("int8"), "reason": datasets.Value("string"),
    })
    fingerprint = hashlib.sha256(f"{ds._fingerprint}|{key}".encode()).hexdigest()[:32]
    return ds.map(
        render_batch, batched=True, batch_size=MAP_BATCH, with_indices=True, num_proc=procs if procs > 1 else None,
        remove_columns=ds.column_names, features=features, new_fingerprint=fingerprint,
        fn_kwargs={"tokenizer": tokenizer, "cfg": cfg, "max_length": max_length, "places": places},
        desc=f"packfsdp: rendering {cfg.source}",
    )


def sample_records(cfg: DataConfig, n: int) -> Iterator[dict]:
    """Up to ``n`` records spread evenly over the source (its first ``data.limit``), in order: what the local
    BPE tokenizer is trained on. Table files are read through ``datasets`` (memory-mapped; the later
    ``map`` reuses that copy), so only the sampled rows become Python records."""
    bad = BadRecords(cfg.on_bad_record, cfg.source)
    parts = list(source_parts(cfg, bad))
    sizes = np.array([len(p.dataset) if isinstance(p, ArrowPart) else len(p) for p in parts], dtype=np.int64)
    if cfg.limit is not None:  # the first ``limit`` records of the parts, in order
        sizes = np.diff(np.minimum(np.concatenate([[0], np.cumsum(sizes)]), cfg.limit))
    total = int(sizes.sum())
    picked = np.unique(np.linspace(0, total - 1, min(n, total)).astype(np.int64)) if total else np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for k, part in enumerate(parts):
        rows = (picked[(picked >= starts[k]) & (picked < starts[k + 1])] - starts[k]).tolist()
        if not rows:
            continue
        if isinstance(part, ArrowPart):
            ds = mapped_columns_only(part.dataset, cfg).select(rows)
            yield from rows_to_records([Row(r) for r in ds], cfg, bad)
        else:
            yield from (part[i] for i in rows)
