"""Data sources: small functions, registered by name, that read raw records.

A source takes the ``DataConfig`` and returns a list of records. A record is a dict; today's renderer
(``trainer.data.dataset``) understands ``{"turns": [utterance, ...]}``. Adding a format means registering
one function here, not touching the loop::

    @register_source("my_format")
    def my_format(cfg: DataConfig) -> list[dict]:
        ...
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from trainer.config import ConfigError, DataConfig
from trainer.data.synthetic import generate_dialogs

log = logging.getLogger(__name__)

Record = dict
SourceFn = Callable[[DataConfig], list[Record]]
SOURCES: dict[str, SourceFn] = {}


def register_source(name: str) -> Callable[[SourceFn], SourceFn]:
    def wrap(fn: SourceFn) -> SourceFn:
        SOURCES[name] = fn
        return fn

    return wrap


def load_records(cfg: DataConfig) -> list[Record]:
    if cfg.source not in SOURCES:
        raise ConfigError(f"data.source={cfg.source!r} is not registered; choose one of: {', '.join(sorted(SOURCES))}")
    records = SOURCES[cfg.source](cfg)
    return records[: cfg.limit] if cfg.limit is not None else records


@register_source("dailydialog_synthetic")
def dailydialog_synthetic(cfg: DataConfig) -> list[Record]:
    """The generated DailyDialog-like corpus (offline; see ``trainer.data.synthetic``)."""
    return [{"turns": d} for d in generate_dialogs(cfg.num_dialogs, cfg.seed)]


@register_source("dailydialog")
def dailydialog(cfg: DataConfig) -> list[Record]:
    """DailyDialog from, in order of preference: the original ``dialogues_text.txt`` (utterances separated
    by ``__eou__``), a local parquet file or folder (rows with a ``dialog`` list), or a hub dataset id."""
    if not cfg.path:
        raise ConfigError("data.path must name a DailyDialog file, folder or hub id for data.source=dailydialog")
    path = Path(cfg.path).expanduser()
    if path.is_file() and path.suffix == ".txt":
        return [{"turns": turns} for turns in read_dailydialog_text(path)]
    if path.is_file() and path.suffix == ".parquet":
        return [{"turns": turns} for turns in read_dialog_parquet([path])]
    if path.is_dir():
        files = sorted(path.rglob(f"*{cfg.split}*.parquet")) or sorted(path.rglob("*.parquet"))
        text = sorted(path.rglob(f"dialogues_text.txt"))
        if files:
            return [{"turns": turns} for turns in read_dialog_parquet(files)]
        if text:
            return [{"turns": turns} for turns in read_dailydialog_text(text[0])]
        raise FileNotFoundError(f"{path}: no *.parquet or dialogues_text.txt inside")
    if path.exists():
        raise ConfigError(f"data.path={cfg.path}: expected a .txt, a .parquet or a folder")
    return [{"turns": turns} for turns in _hub_dialogs(cfg.path, cfg.split)]


def read_dailydialog_text(path: Path) -> list[list[str]]:
    """The original format: one dialog per line, each utterance followed by ``__eou__``."""
    dialogs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            dialogs.append([u.strip() for u in line.split("__eou__") if u.strip()])
    return dialogs


def read_dialog_parquet(files: list[Path]) -> list[list[str]]:
    import pyarrow.parquet as pq

    dialogs = []
    for file in files:
        table = pq.read_table(file)
        if "dialog" not in table.column_names:
            raise ValueError(f"{file}: no 'dialog' column (columns: {', '.join(table.column_names)})")
        for row in table.column("dialog").to_pylist():
            dialogs.append([u.strip() for u in (row or []) if u and u.strip()])
    return dialogs


def _hub_dialogs(hub_id: str, split: str) -> list[list[str]]:
    import datasets

    ds = datasets.load_dataset(hub_id, split=split)
    if "dialog" not in ds.column_names:
        raise ValueError(f"{hub_id}: no 'dialog' column (columns: {', '.join(ds.column_names)})")
    return [[u.strip() for u in row if u and u.strip()] for row in ds["dialog"]]
