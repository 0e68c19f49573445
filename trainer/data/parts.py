"""The one dispatcher: a source's parts, in reading order, for every route (cache, stream, tokenizer sample).

``source_parts`` opens ``data.source`` as ``Part``s, each a table of rows or a list of records:

- a shipped table source (``jsonl`` / ``parquet`` / ``csv``, ``trainer.data.tables.FORMATS``): one part per
  file, read by ``datasets`` (into memory-mapped Arrow, or streamed); a file ``datasets`` refuses, or whose
  strings are not UTF-8 (pyarrow's JSON reader keeps such bytes, and reading the row later fails), is read by
  the format's line reader instead (the fallback, which names the bad line) and comes back as records.
  Consecutive small files (under ``SMALL_FILE_BYTES``) are one part, read by the line reader in one pass (up
  to ``GROUP_BYTES``): a ``datasets`` load costs tens of milliseconds whatever the file's size;
- ``hf``: the dataset ``data.path`` names (a hub id, a local dataset folder), ranks streaming it get
  disjoint shards (``split_by_node``);
- every other source, as registered (``trainer.data.sources.SOURCES``, plugins included: a plugin that
  registers ``jsonl`` is what is read): its records, or the ``datasets.(Iterable)Dataset`` it returns.

A row's place (``Places``) names it for the user: ``file:line`` for JSON Lines and CSV, else ``NAME row i``.
"""

from __future__ import annotations

import csv
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow as pa

from trainer.config import DataConfig
from trainer.data.bad_records import BadRecords, check_not_empty
from trainer.data.sources import check_hf_path, check_source, open_hf_dataset, shipped
from trainer.data.tables import FORMATS, TableFormat, detect_columns, mapped_columns_only, rows_to_records, table_files
from trainer.library_log import library_load

log = logging.getLogger(__name__)

SMALL_FILE_BYTES = 1 << 20
"""Files under this size are read together, by the line reader (see the module docstring)."""
GROUP_BYTES = 16 << 20
"""The most bytes of small files in one part (its records are held in memory together)."""


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


@dataclass(frozen=True)
class Part:
    """One part of a source: ``open()`` gives a ``datasets`` Dataset (streaming: an IterableDataset) of rows,
    a list of records, or ``None`` (an empty file, reported)."""

    places: Places
    open: Callable[[], object]
    split_by_node: bool = False
    """Streaming ranks get disjoint shards (``split_dataset_by_node``); else every rank reads all rows and
    keeps its own."""

    @property
    def name(self) -> str:
        return self.places.name


def source_parts(cfg: DataConfig, bad: BadRecords, streaming: bool = False) -> list[Part]:
    """``cfg``'s source as parts, in reading order (see the module docstring); nothing is read until a part
    is opened. ``streaming``: tables are ``datasets`` streams, never copied into Arrow."""
    name = shipped(cfg)
    if name in FORMATS:
        fmt = FORMATS[name]
        return [
            Part(Places(str(files[0]), fmt.lines), functools.partial(_open_file, fmt, files[0], cfg, bad, streaming))
            if len(files) == 1
            else Part(
                Places(f"{files[0]} .. {files[-1]} ({len(files)} files)"),
                functools.partial(_read_lines, fmt, files, cfg, bad),
            )
            for files in small_files_together(table_files(cfg, fmt.suffixes))
        ]
    if name == "hf":
        check_hf_path(cfg)
        return [Part(Places(f"data.path={cfg.path}"), functools.partial(_open_hf, cfg, streaming), split_by_node=True)]
    source = check_source(cfg)
    return [
        Part(
            Places(f"data.source={cfg.source}"),
            functools.partial(_registered, source, cfg, streaming),
            split_by_node=True,
        )
    ]


def small_files_together(files: list[Path]) -> list[list[Path]]:
    """``files`` in order, as parts: a file of ``SMALL_FILE_BYTES`` or more alone, consecutive smaller ones
    together up to ``GROUP_BYTES``."""
    parts: list[list[Path]] = []
    small: list[Path] = []
    size = 0
    for f in files:
        n = f.stat().st_size
        if small and (n >= SMALL_FILE_BYTES or size + n > GROUP_BYTES):
            parts.append(small)
            small, size = [], 0
        if n >= SMALL_FILE_BYTES:
            parts.append([f])
        else:
            small.append(f)
            size += n
    return parts + ([small] if small else [])


def _read_lines(fmt: TableFormat, files: list[Path], cfg: DataConfig, bad: BadRecords) -> list:
    """Small files read by the format's line reader in one pass; each record keeps its ``file:line``."""
    return rows_to_records(fmt.read(files, bad), cfg, bad)


def _open_file(fmt: TableFormat, file: Path, cfg: DataConfig, bad: BadRecords, streaming: bool):
    if streaming:
        with library_load(f"data.path={file}"):
            return datasets.load_dataset(
                fmt.builder, data_files=str(file), split="train", streaming=True, **reader_options(fmt.builder, file)
            )
    try:
        ds = datasets.load_dataset(
            fmt.builder,
            data_files=str(file),
            split="train",
            cache_dir=str(Path(cfg.cache_dir).expanduser() / "hf"),
            **reader_options(fmt.builder, file),
        )
    except Exception as e:  # noqa: BLE001 - any parse failure: the line reader names the place or skips it
        reason = f"not read by datasets ({str(e)[:200]})"
    else:
        reason = _line_reader_reason(ds, cfg)
    if reason is not None:
        log.info("data %s: %s %s; reading it line by line", cfg.source, file, reason)
        return _read_lines(fmt, [file], cfg, bad)
    check_not_empty(file, len(ds), bad)
    return ds if len(ds) else None


def _line_reader_reason(ds, cfg: DataConfig) -> str | None:
    """Why the line reader reads this file rather than the table ``datasets`` built, if it must."""
    try:
        mapped_columns_only(ds, cfg).data.table.validate(full=True)  # the UTF-8 of the strings read, ~3 GB/s
    except pa.ArrowInvalid as e:
        return f"holds text that is not UTF-8 ({str(e)[:200]})"
    if (column := _float_token_column(ds, cfg)) is not None:
        # One float in one row types the whole column float in Arrow: every row would then look bad (or be
        # skipped). The line reader reads each row as written, so only the bad row is named (or skipped).
        return f"has column {column!r} typed float by datasets"
    return None


def _float_token_column(ds, cfg: DataConfig) -> str | None:
    """A pre-tokenized id column (``input_ids``, ``labels``) that ``datasets`` typed as floats, if any."""
    columns = dict(cfg.columns) or detect_columns(ds.column_names)
    for field in ("input_ids", "labels"):
        feature = ds.features.get(columns.get(field, ""))
        inner = getattr(feature, "feature", None)  # Sequence / List of a Value
        if isinstance(inner, datasets.Value) and inner.dtype.startswith("float"):
            return columns[field]
    return None


def _open_hf(cfg: DataConfig, streaming: bool):
    with library_load(f"data.path={cfg.path}"):
        if not streaming:
            return open_hf_dataset(cfg)
        if Path(cfg.path).expanduser().exists():
            return open_hf_dataset(cfg).to_iterable_dataset()
        return datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split, streaming=True)


def _registered(source: Callable, cfg: DataConfig, streaming: bool) -> object:
    """A registered source's result: a ``Dataset`` as it is (streaming: its ``to_iterable_dataset()``), an
    ``IterableDataset`` when streaming, else its records as a list."""
    result = source(cfg)
    if isinstance(result, datasets.Dataset):
        return result.to_iterable_dataset() if streaming else result
    if streaming and isinstance(result, datasets.IterableDataset):
        return result
    return result if isinstance(result, list) else list(result)


def is_table(value: object) -> bool:
    """Is an opened part a ``datasets`` table of rows (else a list of records)."""
    return not isinstance(value, list)


def reader_options(builder: str, file: Path) -> dict:
    """``load_dataset`` options of a file builder: CSV cells stay strings, an empty one "", as Python's csv
    module reads them (pandas would infer numbers and NaN): every column of the header typed ``string``."""
    if builder != "csv":
        return {}
    with open(file, newline="", encoding="utf-8-sig", errors="replace") as f:
        header = next(csv.reader(f), [])
    features = datasets.Features({name: datasets.Value("string") for name in header}) if header else None
    return {"features": features, "keep_default_na": False, "na_filter": False}


__all__ = ["Part", "Places", "is_table", "reader_options", "source_parts"]
