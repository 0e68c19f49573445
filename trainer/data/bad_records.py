"""Bad input records: an error naming the file and line, or (``data.on_bad_record=skip``) a counted, logged skip.

Readers report every problem through one ``BadRecords`` per load, with the place it happened
(``path:line``, or ``path row N`` for formats without lines), so the user can open the file there:

- a line that is not valid JSON, a line that is not UTF-8, a row without the mapped column, a chat message
  whose role is not one the renderer knows, a file with no record at all.

With ``error`` (the default) the first problem raises ``BadRecordError``; with ``skip`` the record (or line,
or file) is left out, counted, and the first few are logged with their place, then a total. The count
reaches ``DatasetStats.dropped_bad`` so the run's log and summary show it. Nothing is dropped silently.

A record larger than ``data.max_record_bytes`` (``record_bytes``: its text in UTF-8, token ids at 4 bytes) is
not bad, only too big to tokenize (one 200 MB line once grew a rank past 11 GB in the tokenizer's training):
it is always skipped before it is tokenized or sampled for the tokenizer, counted
(``DatasetStats.dropped_oversize``) and logged with its place (``BadRecords.oversize``).
"""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOGGED_SKIPS = 10
"""Skips logged one by one (with their place); later ones are only counted."""


class BadRecordError(ValueError):
    """A record, line or file that cannot be read; the message starts with its place."""


class RecordList(list):
    """The records of a source, plus how many bad ones were skipped on the way (``skipped_bad``)."""

    skipped_bad: int = 0


class BadRecords:
    """Collects the problems of one load under ``mode`` (``error`` or ``skip``)."""

    def __init__(self, mode: str = "error", source: str = "") -> None:
        if mode not in ("error", "skip"):
            raise ValueError(f"data.on_bad_record={mode!r} is not valid; choose one of: error, skip")
        self.mode, self.source = mode, source
        self.skipped = 0
        self.reasons: dict[str, int] = {}
        self.oversized = 0
        """Records over ``data.max_record_bytes`` reported here (``oversize``; counted in the stats by outcome)."""

    def bad(self, where: str, reason: str, kind: str = "record") -> None:
        """Report one bad record at ``where``: raise (``error``) or count and log it (``skip``)."""
        if self.mode == "error":
            raise BadRecordError(f"{where}: {reason} (data.on_bad_record=skip skips such {kind}s, counted)")
        self.skipped += 1
        self.reasons[kind] = self.reasons.get(kind, 0) + 1
        if self.skipped <= LOGGED_SKIPS:
            log.warning("skipped bad %s at %s: %s", kind, where, reason)

    def oversize(self, where: str, reason: str) -> None:
        """A record over ``data.max_record_bytes`` at ``where``: always skipped; the first few are logged."""
        self.oversized += 1
        if self.oversized <= LOGGED_SKIPS:
            log.warning("skipped record at %s: %s", where, reason)

    def finish(self, records: list) -> RecordList:
        """``records`` as a ``RecordList`` carrying the skip count; logs the total once."""
        out = RecordList(records)
        out.skipped_bad = self.skipped
        if self.skipped:
            parts = ", ".join(f"{n} {k}(s)" for k, n in sorted(self.reasons.items()))
            log.warning(
                "data %s: skipped %d bad input(s): %s (data.on_bad_record=skip)", self.source, self.skipped, parts
            )
        if self.oversized:
            log.warning("data %s: skipped %d record(s) over data.max_record_bytes", self.source, self.oversized)
        return out


def utf8_lines(path: Path, bad: BadRecords) -> Iterator[tuple[int, str]]:
    """``(line_number, text)`` of a text file, decoding each line on its own so a non-UTF-8 byte is reported
    with its line (a plain ``open(encoding="utf-8")`` fails somewhere inside a read buffer, without one)."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if n == 1 and raw.startswith(codecs.BOM_UTF8):  # Excel's "CSV UTF-8" starts with a byte-order mark
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad.bad(f"{path}:{n}", f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})", "line")


def parse_json(text: str) -> Any:
    """``json.loads`` whose failures are all ``ValueError``: a value nested too deeply (``[[[[...``) makes the
    parser recurse past Python's limit and raise ``RecursionError``, which would escape the bad-record path."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


def record_bytes(value: Any) -> int:
    """A record's size as ``data.max_record_bytes`` counts it: the UTF-8 bytes of every string in it (keys
    included) and 4 bytes per number (a token id), however deeply nested."""
    if isinstance(value, str):
        return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, dict):
        return sum(record_bytes(k) + record_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(record_bytes(v) for v in value)
    return 4


def oversize_reason(size: int, limit: int) -> str:
    return (
        f"{size:,} bytes, over data.max_record_bytes={limit:,} "
        "(skipped before tokenizing; raise it to keep such records)"
    )


def check_not_empty(path: Path, rows_in_file: int, bad: BadRecords) -> None:
    """A file that held no record at all is reported (it is almost always the wrong file)."""
    if rows_in_file == 0:
        bad.bad(str(path), "no record in this file (empty)", "file")
