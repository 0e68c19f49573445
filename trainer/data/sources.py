"""Data sources: small functions, registered by name, that read raw records.

A source takes the ``DataConfig`` and returns a list of records. A record is a dict of one of three kinds
(rendered by ``trainer.data.render``): ``{"messages": [{"role", "content"}, ...]}`` (chat),
``{"turns": [utterance, ...]}`` (a dialog) or ``{"text": str}`` (a plain document). Adding a format means
registering one function, not touching the loop; a module of your own is imported through
``data.plugins``::

    from trainer.data import register_source

    @register_source("my_format")
    def my_format(cfg: DataConfig) -> list[dict]:
        ...

Shipped sources: the generated ones (offline, ``trainer.config.GENERATED_SOURCES``, ``generated_source``),
``dailydialog`` (original text, parquet or hub), ``chitchat`` (real human dialogues, from an installed package,
offline), ``jsonl`` / ``parquet`` / ``csv`` (local files or folders) and ``hf`` (any hub dataset id, or a local
dataset folder), the table sources with ``data.columns`` mapping.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import datasets

from trainer.config import GENERATED_SOURCES, ConfigError, DataConfig
from trainer.data.bad_records import BadRecords, RecordList, utf8_lines
from trainer.data.chitchat import chitchat_file, read_chitchat
from trainer.data.synthetic import (
    generate_chats,
    generate_dialogs,
    generate_preference_pairs,
    generate_reasoning_traces,
)
from trainer.library_log import library_load

log = logging.getLogger(__name__)

Record = dict
SourceFn = Callable[[DataConfig], list[Record]]
SOURCES: dict[str, SourceFn] = {}
SOURCE_FILES: dict[str, Callable[[DataConfig], list[Path]]] = {}
"""Per source, the files it reads besides ``data.path`` (``register_source(..., files=)``)."""


def register_source(
    name: str, files: Callable[[DataConfig], list[Path]] | None = None
) -> Callable[[SourceFn], SourceFn]:
    """Register ``fn(cfg: DataConfig) -> list[dict]`` as ``data.source=name`` (a shipped name included: the
    registered function is what every route reads). ``files(cfg)``: the files it reads besides ``data.path``
    (an installed package's data, say), whose size and modification time join the cache key."""

    def wrap(fn: SourceFn) -> SourceFn:
        SOURCES[name] = fn
        SOURCE_FILES.pop(name, None)
        if files is not None:
            SOURCE_FILES[name] = files
        return fn

    return wrap


def generated_source(name: str) -> Callable[[SourceFn], SourceFn]:
    """``register_source`` for a source generated offline: one of ``GENERATED_SOURCES`` (the config reads that
    list without importing the data stage: the local BPE may train on a generated source even when streamed)."""
    if name not in GENERATED_SOURCES:
        raise ValueError(f"{name!r} is not in trainer.config.GENERATED_SOURCES")
    return register_source(name)


def check_source(cfg: DataConfig) -> SourceFn:
    """Import ``data.plugins`` and return the registered source (a clear error naming the options)."""
    import_plugins(cfg.plugins)
    if cfg.source not in SOURCES:
        raise ConfigError(
            f"data.source={cfg.source!r} is not registered; choose one of: {', '.join(sorted(SOURCES))} "
            "(a source of your own: register_source in a module listed in data.plugins)"
        )
    return SOURCES[cfg.source]


def load_records(cfg: DataConfig) -> list[Record]:
    records = check_source(cfg)(cfg)
    if not isinstance(records, list):
        records = list(records)
    if cfg.limit is None:
        return records
    limited = RecordList(records[: cfg.limit])
    limited.skipped_bad = getattr(records, "skipped_bad", 0)  # skips stay counted
    return limited


def import_plugins(plugins: list[str]) -> None:
    """Import each plugin once: a ``.py`` path (relative to the working directory) or a dotted module name."""
    for plugin in plugins:
        plugin_path(plugin)  # fails early with a clear message when it cannot be found
        if plugin.endswith(".py"):
            path = Path(plugin).expanduser().resolve()
            name = f"packfsdp_plugin_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
            if name in sys.modules:
                continue
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            importlib.import_module(plugin)


def plugin_path(plugin: str) -> Path:
    """The file a plugin is loaded from (its size and mtime are part of the dataset cache key)."""
    if plugin.endswith(".py"):
        path = Path(plugin).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.plugins: {plugin} is not a file (relative paths start at {Path.cwd()})")
        return path.resolve()
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # `torchrun -m` and console scripts do not add it themselves
    spec = importlib.util.find_spec(plugin)
    if spec is None or spec.origin is None:
        raise ConfigError(f"data.plugins: cannot import {plugin!r} (not on sys.path nor in {Path.cwd()})")
    return Path(spec.origin)


@generated_source("dailydialog_synthetic")
def dailydialog_synthetic(cfg: DataConfig) -> list[Record]:
    """The generated DailyDialog-like corpus (offline; see ``trainer.data.synthetic``)."""
    return [{"turns": d} for d in generate_dialogs(cfg.num_records, cfg.seed)]


@generated_source("chat_synthetic")
def chat_synthetic(cfg: DataConfig) -> list[Record]:
    """Generated chat conversations (system / user / assistant; offline; see ``trainer.data.synthetic``)."""
    return [{"messages": m} for m in generate_chats(cfg.num_records, cfg.seed)]


@generated_source("reasoning_synthetic")
def reasoning_synthetic(cfg: DataConfig) -> list[Record]:
    """Generated long, long-tailed question + reasoning-trace pairs (offline; ``trainer.data.synthetic``)."""
    return [{"turns": t} for t in generate_reasoning_traces(cfg.num_records, cfg.seed)]


@generated_source("preference_synthetic")
def preference_synthetic(cfg: DataConfig) -> list[Record]:
    """Generated preference pairs (prompt / chosen / rejected chats, long-tailed replies, a learnable
    preference; offline; see ``trainer.data.synthetic``)."""
    return generate_preference_pairs(cfg.num_records, cfg.seed)


@register_source("dailydialog")
def dailydialog(cfg: DataConfig) -> list[Record]:
    """DailyDialog from, in order of preference: the original ``dialogues_text.txt`` (utterances separated
    by ``__eou__``), a local parquet file or folder (rows with a ``dialog`` list), or a hub dataset id."""
    if not cfg.path:
        raise ConfigError("data.path must name a DailyDialog file, folder or hub id for data.source=dailydialog")
    path = Path(cfg.path).expanduser()
    if path.is_file() and path.suffix == ".txt":
        bad = BadRecords(cfg.on_bad_record, cfg.source)
        return bad.finish([{"turns": turns} for turns in read_dailydialog_text(path, bad)])
    if path.is_file() and path.suffix == ".parquet":
        bad = BadRecords(cfg.on_bad_record, cfg.source)
        return bad.finish([{"turns": turns} for turns in read_dialog_parquet([path], bad)])
    if path.is_dir():
        files = sorted(path.rglob(f"*{cfg.split}*.parquet")) or sorted(path.rglob("*.parquet"))
        text = sorted(path.rglob("dialogues_text.txt"))
        if files:
            bad = BadRecords(cfg.on_bad_record, cfg.source)
            return bad.finish([{"turns": turns} for turns in read_dialog_parquet(files, bad)])
        if text:
            bad = BadRecords(cfg.on_bad_record, cfg.source)
            return bad.finish([{"turns": turns} for turns in read_dailydialog_text(text[0], bad)])
        raise FileNotFoundError(f"{path}: no *.parquet or dialogues_text.txt inside")
    if path.exists():
        raise ConfigError(f"data.path={cfg.path}: expected a .txt, a .parquet or a folder")
    return [{"turns": turns} for turns in _hub_dialogs(cfg.path, cfg.split)]


@register_source("chitchat", files=lambda cfg: [] if cfg.path else [chitchat_file(None)])
def chitchat(cfg: DataConfig) -> list[Record]:
    """The BYU chit-chat challenge's human conversations, a dialog each (``trainer.data.chitchat``): the
    ``chitchat-dataset`` package's JSON (the ``chitchat`` extra), or ``data.path`` naming a copy of it."""
    bad = BadRecords(cfg.on_bad_record, cfg.source)
    return bad.finish([{"turns": turns} for turns in read_chitchat(chitchat_file(cfg.path), bad)])


def read_dailydialog_text(path: Path, bad: BadRecords | None = None) -> list[list[str]]:
    """The original format: one dialog per line, each utterance followed by ``__eou__``. A line that is not
    UTF-8 is an error naming it (or a counted skip with ``bad`` in skip mode)."""
    return [
        [u.strip() for u in line.split("__eou__") if u.strip()] for _, line in utf8_lines(path, bad or BadRecords())
    ]


def read_dialog_parquet(files: list[Path], bad: BadRecords | None = None) -> list[list[str]]:
    """Rows with a ``dialog`` list; an unreadable file follows ``bad`` (an error naming it, or a skip)."""
    dialogs = []
    for file in files:
        rows = read_parquet([file], bad or BadRecords())
        if rows and "dialog" not in rows[0]:
            raise ValueError(f"{file}: no 'dialog' column (columns: {', '.join(rows[0])})")
        dialogs += [[u.strip() for u in (row["dialog"] or []) if u and u.strip()] for row in rows]
    return dialogs


def _hub_dialogs(hub_id: str, split: str) -> list[list[str]]:
    try:
        ds = datasets.load_dataset(hub_id, split=split)
    except Exception as e:  # a script-based hub dataset (datasets >= 4 no longer runs scripts)
        if "script" not in str(e).lower():
            raise
        log.warning("%s: %s; reading the hub's parquet conversion (refs/convert/parquet) instead", hub_id, e)
        ds = datasets.load_dataset(hub_id, split=split, revision="refs/convert/parquet")
    if "dialog" not in ds.column_names:
        raise ValueError(f"{hub_id}: no 'dialog' column (columns: {', '.join(ds.column_names)})")
    return [[u.strip() for u in row if u and u.strip()] for row in ds["dialog"]]


# ---------------------------------------------------------------------------------------------------------
# Table sources: rows with a text, messages, turns or prompt/response column
# ---------------------------------------------------------------------------------------------------------

from trainer.data.tables import FORMATS, mapped_columns_only, read_parquet, rows_to_records, table_files  # noqa: E402


def _table_source(cfg: DataConfig) -> list[Record]:
    """``data.source``'s format (``FORMATS``) read by its line reader, rows mapped to records: bad lines and
    rows follow ``data.on_bad_record`` (error or counted skip). The training routes read these files through
    ``datasets`` (``trainer.data.parts``) and come here only for a file it refuses."""
    fmt = FORMATS[cfg.source]
    bad = BadRecords(cfg.on_bad_record, cfg.source)
    return bad.finish(rows_to_records(fmt.read(table_files(cfg, fmt.suffixes), bad), cfg, bad))


@register_source("jsonl")
def jsonl(cfg: DataConfig) -> list[Record]:
    """Local JSON Lines: a ``.jsonl`` file or a folder of them (``*{split}*.jsonl`` preferred)."""
    return _table_source(cfg)


@register_source("parquet")
def parquet(cfg: DataConfig) -> list[Record]:
    """Local Parquet: a ``.parquet`` file or a folder of them (``*{split}*.parquet`` preferred)."""
    return _table_source(cfg)


@register_source("csv")
def csv(cfg: DataConfig) -> list[Record]:
    """Local CSV with a header row; a ``messages`` cell holds the conversation as a JSON string."""
    return _table_source(cfg)


@register_source("hf")
def hf(cfg: DataConfig) -> list[Record]:
    """Any dataset ``datasets`` opens: a hub id (``data.path``, ``data.subset``, ``data.split``), a local
    dataset folder, a ``save_to_disk`` folder or ``.arrow`` files. Columns are mapped with ``data.columns``."""
    with library_load(f"data.path={cfg.path}"):
        ds = open_hf_dataset(cfg)
    ds = mapped_columns_only(ds, cfg)  # read column-wise: far faster than iterating rows of a large dataset
    bad = BadRecords(cfg.on_bad_record, cfg.source)
    return bad.finish(rows_to_records(ds.to_list(), cfg, bad))


def open_hf_dataset(cfg: DataConfig):
    """``data.path`` as a ``datasets.Dataset``: a ``save_to_disk`` folder (``load_from_disk``; the split of a
    saved ``DatasetDict``), ``.arrow`` files (a file or a folder of them), else ``load_dataset``."""
    check_hf_path(cfg)
    path = Path(cfg.path).expanduser()
    if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if cfg.split not in ds:
                raise ConfigError(
                    f"data.path={cfg.path} has no split {cfg.split!r} (data.split; it has: {', '.join(ds)})"
                )
            ds = ds[cfg.split]
        return ds
    arrow = [path] if path.suffix == ".arrow" else sorted(path.rglob("*.arrow")) if path.is_dir() else []
    if arrow:
        return datasets.load_dataset("arrow", data_files=[str(f) for f in arrow], split="train")
    return datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split)


def check_hf_path(cfg: DataConfig) -> None:
    """``data.source=hf`` reads ``data.path``: without it, one line saying so."""
    if not cfg.path:
        raise ConfigError("data.path must name a hub dataset id (or a local dataset folder) for data.source=hf")


def shipped(cfg: DataConfig) -> str | None:
    """``jsonl``, ``parquet``, ``csv`` or ``hf`` when ``data.source`` is that shipped table source, still
    registered as shipped (the routes then read it through ``datasets``); ``None`` for any other source, and
    for a plugin that registered one of these names itself: its function is what is read."""
    source = check_source(cfg)
    return cfg.source if source is SHIPPED_TABLES.get(cfg.source) else None


SHIPPED_TABLES = {"jsonl": jsonl, "parquet": parquet, "csv": csv, "hf": hf}
"""The shipped table sources, as registered (``shipped``)."""


def source_fingerprint(cfg: DataConfig) -> str:
    """What the records depend on: the config and, for local files and plugin modules, their size and
    modification time (an edited file or source function re-tokenizes)."""
    check_source(cfg)
    parts = asdict(cfg) | {"cache_dir": None, "num_proc": None}  # neither changes the records
    parts.pop("stream")  # how the records are read, not which: cached datasets keep their key
    files: list[Path] = [plugin_path(p) for p in cfg.plugins]
    files += SOURCE_FILES[cfg.source](cfg) if cfg.source in SOURCE_FILES else []
    if cfg.path and Path(cfg.path).expanduser().exists():
        p = Path(cfg.path).expanduser()
        files += sorted(p.rglob("*")) if p.is_dir() else [p]
    parts["files"] = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    return json.dumps(parts, sort_keys=True, default=str)
