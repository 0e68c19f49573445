"""Rows of a table (JSONL, Parquet, CSV, a ``datasets`` dataset) turned into records.

The column mapping ``data.columns`` says which of your columns holds which packfsdp field::

    text       a plain document                          -> {"text": ...}
    messages   a list of {role, content} (or a JSON str) -> {"messages": [...]}  (chat)
    turns      a list of utterances                      -> {"turns": [...]}     (dialog)
    prompt + response (+ system)                         -> a two- or three-message chat
    role, content   the keys inside each message (ShareGPT: from, value)

With no mapping the columns are recognised by name: ``messages`` or ``conversations`` (chat), ``text``,
``turns`` or ``dialog``, ``prompt`` with ``response`` or ``completion``. ShareGPT roles (``human``,
``gpt``) become ``user`` / ``assistant``; ``data.roles`` renames any others.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from pathlib import Path

from trainer.config import ConfigError, DataConfig

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


def read_jsonl(files: list[Path]) -> list[dict]:
    rows = []
    for file in files:
        with open(file, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{file}:{n}: not valid JSON ({e.msg})") from None
    return rows


def read_parquet(files: list[Path]) -> list[dict]:
    import pyarrow.parquet as pq

    return [row for file in files for row in pq.read_table(file).to_pylist()]


def read_csv(files: list[Path]) -> list[dict]:
    rows = []
    for file in files:
        with open(file, encoding="utf-8", newline="") as f:
            rows += list(csv.DictReader(f))
    return rows


def detect_columns(names: Iterable[str]) -> dict[str, str]:
    """The mapping for well-known column names (``data.columns`` left empty)."""
    names = set(names)
    for field, candidates in (("messages", ("messages", "conversations")), ("text", ("text",)),
                              ("turns", ("turns", "dialog"))):
        for c in candidates:
            if c in names:
                return {field: c}
    if "prompt" in names:
        for response in ("response", "completion"):
            if response in names:
                return {"prompt": "prompt", "response": response} | ({"system": "system"} if "system" in names else {})
    return {}


def rows_to_records(rows: Iterable[dict], cfg: DataConfig) -> list[dict]:
    """Map every row to a record with ``data.columns`` (or the detected mapping)."""
    rows = rows if isinstance(rows, list) else list(rows)
    if not rows:
        return []
    columns = dict(cfg.columns) or detect_columns(rows[0].keys())
    kinds = [k for k in ("messages", "text", "turns", "prompt") if k in columns]
    if len(kinds) != 1 or (kinds[0] == "prompt" and "response" not in columns):
        raise ConfigError(
            f"data.source={cfg.source}: cannot tell which column holds the data (columns: "
            f"{', '.join(map(str, rows[0].keys()))}); set data.columns, e.g. data.columns={{text: body}}, "
            "{messages: chat}, {turns: utterances} or {prompt: question, response: answer}"
        )
    kind = kinds[0]
    missing = [c for f, c in columns.items() if f not in ("role", "content") and c not in rows[0]]
    if missing:
        raise ConfigError(f"data.columns names {', '.join(missing)}, not among: {', '.join(map(str, rows[0].keys()))}")
    roles = SHAREGPT_ROLES | dict(cfg.roles)
    role_key, content_key = columns.get("role"), columns.get("content")

    records = []
    for i, row in enumerate(rows):
        where = f"data.source={cfg.source} row {i}"
        if kind == "text":
            records.append({"text": row[columns["text"]]})
        elif kind == "turns":
            records.append({"turns": [t for t in (row[columns["turns"]] or []) if t is not None]})
        elif kind == "prompt":
            messages = [{"role": "system", "content": row[columns["system"]]}] if row.get(columns.get("system")) else []
            messages += [{"role": "user", "content": row[columns["prompt"]] or ""},
                         {"role": "assistant", "content": row[columns["response"]] or ""}]
            records.append({"messages": messages})
        else:
            records.append({"messages": normalise_messages(row[columns["messages"]], role_key, content_key, roles, where)})
    return records


def normalise_messages(value, role_key: str | None, content_key: str | None, roles: dict[str, str], where: str) -> list:
    """``[{role, content}]`` from a list (or JSON string) of messages with any key names."""
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: the messages cell is a string but not JSON ({e.msg})") from None
    if not isinstance(value, list):
        raise ValueError(f"{where}: messages must be a list, got {type(value).__name__}")
    out = []
    for m in value:
        if not isinstance(m, dict):
            raise ValueError(f"{where}: a message must be a dict, got {m!r}")
        rk = role_key or ("role" if "role" in m else "from")
        ck = content_key or ("content" if "content" in m else "value")
        if rk not in m or ck not in m:
            raise ValueError(f"{where}: message {m!r} has no {rk!r}/{ck!r}; set data.columns.role / data.columns.content")
        content = m[ck]
        if isinstance(content, list):  # OpenAI-style parts: keep the text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append({"role": roles.get(m[rk], m[rk]), "content": "" if content is None else content})
    return out
