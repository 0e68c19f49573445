"""Rows of a table (JSONL, Parquet, CSV, a ``datasets`` dataset) turned into records.

The column mapping ``data.columns`` says which of your columns holds which packfsdp field::

    text       a plain document                          -> {"text": ...}
    messages   a list of {role, content} (or a JSON str) -> {"messages": [...]}  (chat)
    turns      a list of utterances                      -> {"turns": [...]}     (dialog)
    prompt + response (+ system)                         -> a two- or three-message chat
    prompt + chosen + rejected   a preference pair (strings or message lists; trainer.data.pairs)
    role, content   the keys inside each message (ShareGPT: from, value)

With no mapping the columns are recognised by name: ``messages`` or ``conversations`` (chat), ``text``,
``turns`` or ``dialog``, ``prompt`` with ``response`` or ``completion``. ShareGPT roles (``human``,
``gpt``) become ``user`` / ``assistant``; ``data.roles`` renames any others. A table with ``input_ids``
is pre-tokenized (with ``labels``, ``loss_mask`` and/or ``attention_mask``; ``trainer.data.pretokenized``).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from trainer.config import ConfigError, DataConfig
from trainer.data.bad_records import BadRecords, check_not_empty, parse_json, utf8_lines
from trainer.data.chat import MEDIA_KEYS, media_key, media_part, media_refusal
from trainer.data.pairs import PAIR_FIELDS, TOKEN_PAIR_FIELDS
from trainer.data.pretokenized import TOKEN_FIELDS

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}


def table_files(cfg: DataConfig, suffixes: tuple[str, ...]) -> list[Path]:
    """``data.path`` as a list of files: the file itself, or a folder's files of the split (else all)."""
    if not cfg.path:
        raise ConfigError(f"data.path must name a {'/'.join(suffixes)} file or folder for data.source={cfg.source}")
    path = Path(cfg.path).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = [f for f in sorted(path.rglob("*")) if f.is_file() and f.name.endswith(suffixes)]
        of_split = [f for f in files if cfg.split in f.name]
        if files:
            return of_split or files
        raise ConfigError(f"data.path={cfg.path}: no {' or '.join(suffixes)} file inside")
    raise ConfigError(f"data.path={cfg.path}: no such file or folder")


class Row(dict):
    """A table row that remembers where it came from (``path:line`` or ``path row N``) for error messages."""

    where: str = ""


def _row(values: dict, where: str) -> Row:
    row = Row(values)
    row.where = where
    return row


def read_jsonl(files: list[Path], bad: BadRecords | None = None) -> list[dict]:
    bad = bad or BadRecords()
    rows = []
    for file in files:
        before, skipped_before = len(rows), bad.skipped
        for n, line in utf8_lines(file, bad):
            if not line.strip():
                continue
            try:
                value = parse_json(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                bad.bad(f"{file}:{n}", f"not valid JSON ({e.msg}, column {e.colno})", "line")
                continue
            except ValueError as e:
                bad.bad(f"{file}:{n}", f"not readable JSON ({e})", "line")
                continue
            if not isinstance(value, dict):
                bad.bad(f"{file}:{n}", f"a JSON {type(value).__name__}, not an object", "line")
                continue
            rows.append(_row(value, f"{file}:{n}"))
        check_not_empty(file, len(rows) - before + bad.skipped - skipped_before, bad)  # bad lines are not "empty"
    return rows


def read_parquet(files: list[Path], bad: BadRecords | None = None) -> list[dict]:
    bad = bad or BadRecords()
    rows = []
    for file in files:
        try:
            table = pq.read_table(file).to_pylist()
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
            bad.bad(str(file), f"not a readable Parquet file ({str(e).strip().splitlines()[0]})", "file")
            continue
        rows += [_row(r, f"{file} row {i}") for i, r in enumerate(table)]
        check_not_empty(file, len(table), bad)
    return rows


CSV_FIELD_LIMIT = 1 << 30
"""Largest CSV cell read (bytes); Python's default, 128 KiB, is smaller than one long document."""


def read_csv(files: list[Path], bad: BadRecords | None = None) -> list[dict]:
    bad = bad or BadRecords()
    rows = []
    previous_limit = csv.field_size_limit(CSV_FIELD_LIMIT)
    try:
        for file in files:
            before = len(rows)
            reader = csv.DictReader(line for _, line in utf8_lines(file, bad))
            while True:
                try:
                    values = next(reader)
                except StopIteration:
                    break
                except csv.Error as e:  # a malformed row: the reader resumes at the next line
                    bad.bad(f"{file}:{reader.reader.line_num}", f"not a valid CSV row ({e})")
                    continue
                rows.append(_row(values, f"{file}:{reader.line_num}"))
            check_not_empty(file, len(rows) - before, bad)
    finally:
        csv.field_size_limit(previous_limit)
    return rows


@dataclass(frozen=True)
class TableFormat:
    """A local file format: the ``datasets`` builder that reads (or streams) it, its file suffixes, and the
    line reader that is the fallback where ``datasets`` refuses a file (it names the bad line)."""

    builder: str
    suffixes: tuple[str, ...]
    read: Callable[[list[Path], BadRecords | None], list[dict]]

    @property
    def lines(self) -> str:
        """``json`` or ``csv``: rows are lines of the file, named ``file:line``; ``""`` (Parquet): ``file row i``."""
        return self.builder if self.builder in ("json", "csv") else ""


FORMATS = {
    "jsonl": TableFormat("json", (".jsonl", ".json"), read_jsonl),
    "parquet": TableFormat("parquet", (".parquet",), read_parquet),
    "csv": TableFormat("csv", (".csv",), read_csv),
}
"""The table file sources (``data.source``), the one table of formats every route reads."""


def detect_columns(names: Iterable[str]) -> dict[str, str]:
    """The mapping for well-known column names (``data.columns`` left empty)."""
    names = set(names)
    for fields in (TOKEN_PAIR_FIELDS, PAIR_FIELDS):  # preference pairs
        if fields[1] in names and fields[2] in names:
            return {f: f for f in fields if f in names}
    if "input_ids" in names:  # pre-tokenized: the ids and whichever mask columns came with them
        return {name: name for name in TOKEN_FIELDS if name in names}
    for field, candidates in (
        ("messages", ("messages", "conversations")),
        ("text", ("text",)),
        ("turns", ("turns", "dialog")),
    ):
        for c in candidates:
            if c in names:
                return {field: c}
    if "prompt" in names:
        for response in ("response", "completion"):
            if response in names:
                return {"prompt": "prompt", "response": response} | ({"system": "system"} if "system" in names else {})
    return {}


def mapped_columns_only(ds, cfg: DataConfig):
    """A ``datasets.Dataset`` cut to the columns ``data.columns`` (or the detected mapping) reads, so rows
    are read column-wise and unused columns are never loaded; unchanged when none of them is there."""
    columns = dict(cfg.columns) or detect_columns(ds.column_names)
    keep = [c for f, c in columns.items() if f not in ("role", "content") and c in ds.column_names]
    keep += [c for c in MEDIA_KEYS if c in ds.column_names and c not in keep]  # read to refuse its rows, never dropped
    return ds.select_columns(keep) if keep else ds


def rows_to_records(rows: Iterable[dict], cfg: DataConfig, bad: BadRecords | None = None) -> list[dict]:
    """Map every row to a record with ``data.columns`` (or the detected mapping). A row that lacks a
    mapped column or holds malformed messages goes to ``bad`` (an error naming its place, or a skip)."""
    bad = bad or BadRecords()
    rows = rows if isinstance(rows, list) else list(rows)
    if not rows:
        return []
    columns = dict(cfg.columns) or detect_columns(rows[0].keys())
    kinds = [k for k in ("messages", "text", "turns", "prompt", "input_ids") if k in columns]
    if "chosen" in columns or "chosen_input_ids" in columns:  # a pair (its prompt is part of it)
        kinds = ["chosen_input_ids" if "chosen_input_ids" in columns else "chosen"]
    if len(kinds) != 1 or (kinds[0] == "prompt" and "response" not in columns):
        raise ConfigError(
            f"data.source={cfg.source}: cannot tell which column holds the data (columns: "
            f"{', '.join(map(str, rows[0].keys()))}); set data.columns, e.g. data.columns={{text: body}}, "
            "{messages: chat}, {turns: utterances}, {prompt: question, response: answer} "
            "or {input_ids: ids, labels: lab}"
        )
    kind = kinds[0]
    wanted = [c for f, c in columns.items() if f not in ("role", "content", "system")]
    missing = [c for c in wanted if c not in rows[0]]
    if missing:
        first = getattr(rows[0], "where", "") or f"data.source={cfg.source} row 0"
        raise ConfigError(
            f"{first}: data.columns names {', '.join(missing)}, not among: {', '.join(map(str, rows[0].keys()))}"
        )
    roles = SHAREGPT_ROLES | dict(cfg.roles)
    role_key, content_key = columns.get("role"), columns.get("content")

    records = []
    for i, row in enumerate(rows):
        where = getattr(row, "where", "") or f"data.source={cfg.source} row {i}"
        absent = [c for c in wanted if c not in row]
        if absent:
            bad.bad(where, f"no column {', '.join(map(repr, absent))} (columns: {', '.join(map(str, row))})")
            continue
        if media := media_key(row):
            bad.bad(where, media_refusal(f"the record holds {media!r}"))
            continue
        try:
            if kind == "chosen_input_ids":
                record = {name: row[columns[name]] for name in TOKEN_PAIR_FIELDS if name in columns}
            elif kind == "chosen":
                record = {
                    name: _pair_side(row.get(columns.get(name, name)), role_key, content_key, roles, where)
                    for name in PAIR_FIELDS
                }
            elif kind == "input_ids":
                record = {name: row[columns[name]] for name in TOKEN_FIELDS if name in columns}
            elif kind == "text":
                record = {"text": row[columns["text"]]}
            elif kind == "turns":
                record = {"turns": [t for t in (row[columns["turns"]] or []) if t is not None]}
            elif kind == "prompt":
                messages = (
                    [{"role": "system", "content": row[columns["system"]]}] if row.get(columns.get("system")) else []
                )
                messages += [
                    {"role": "user", "content": row[columns["prompt"]] or ""},
                    {"role": "assistant", "content": row[columns["response"]] or ""},
                ]
                record = {"messages": messages}
            else:
                record = {"messages": normalise_messages(row[columns["messages"]], role_key, content_key, roles, where)}
        except (ValueError, TypeError) as e:
            bad.bad(where, str(e).removeprefix(f"{where}: "))
            continue
        records.append(_row(record, where))  # the record keeps its place for the renderer's messages
    return records


def _pair_side(value, role_key: str | None, content_key: str | None, roles: dict[str, str], where: str):
    """One field of a pair row: a string as it is, a list of messages normalised (``None``: missing)."""
    if value is None or isinstance(value, str):
        return value
    return normalise_messages(value, role_key, content_key, roles, where)


def normalise_messages(value, role_key: str | None, content_key: str | None, roles: dict[str, str], where: str) -> list:
    """``[{role, content}]`` from a list (or JSON string) of messages with any key names."""
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = parse_json(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: the messages cell is a string but not JSON ({e.msg})") from None
        except ValueError as e:
            raise ValueError(f"{where}: the messages cell is not readable JSON ({e})") from None
    if not isinstance(value, list):
        raise ValueError(f"{where}: messages must be a list, got {type(value).__name__}")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: a message must be a dict, got {m!r}")
        rk = role_key or ("role" if "role" in m else "from")
        ck = content_key or ("content" if "content" in m else "value")
        if rk not in m or ck not in m:
            raise ValueError(
                f"{where}: message {m!r} has no {rk!r}/{ck!r}; set data.columns.role / data.columns.content"
            )
        content = m[ck]
        if kind := media_part(content):  # never dropped silently: the text around an image is about the image
            raise ValueError(f"{where}: {media_refusal(f'message {k} holds an {kind!r} part')}")
        if isinstance(content, list):  # OpenAI-style parts: keep the text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append({"role": roles.get(m[rk], m[rk]), "content": "" if content is None else content})
    return out
