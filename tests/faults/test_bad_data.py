"""Item 4: bad input data is an error naming the file and line, or (``data.on_bad_record=skip``) a counted,
logged skip; an over-long example follows the configured rule and is counted. Nothing is dropped silently."""

from __future__ import annotations

import json
import logging

import pytest

from tests.data_oracle import render_records
from trainer.config import DataConfig
from trainer.data import load_records
from trainer.data.bad_records import BadRecordError


def _cfg(path, source="jsonl", **kw) -> DataConfig:
    return DataConfig(source=source, path=str(path), **kw)


def _write_jsonl(path, lines: list) -> None:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))


GOOD = {"text": "hello there"}
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize(
    "lines, line, message",
    [
        ([GOOD, b'{"text": "unterminated', GOOD], 2, "not valid JSON (Unterminated string"),
        ([GOOD, GOOD, b'{"text": "caf\xe9"}'], 3, "not UTF-8 (byte 0xe9 at column 14)"),
        ([GOOD, {"body": "the wrong column"}, GOOD], 2, "no column 'text' (columns: body)"),
        ([GOOD, b"[1, 2]", GOOD], 2, "a JSON list, not an object"),
    ],
)
def test_bad_line_is_an_error_naming_file_and_line_or_a_counted_skip(tmp_path, caplog, lines, line, message):
    path = tmp_path / "train.jsonl"
    _write_jsonl(path, lines)
    with pytest.raises(BadRecordError) as info:
        load_records(_cfg(path))
    assert str(info.value).startswith(f"{path}:{line}: {message}"), str(info.value)
    assert "data.on_bad_record=skip" in str(info.value)
    with caplog.at_level(logging.WARNING):
        records = load_records(_cfg(path, on_bad_record="skip"))
    assert len(records) == 2 and records.skipped_bad == 1
    assert "skipped bad" in caplog.text and f"{path}:{line}" in caplog.text


def test_empty_file_is_an_error_or_a_counted_skip(tmp_path):
    (tmp_path / "a_train.jsonl").write_text("")
    _write_jsonl(tmp_path / "b_train.jsonl", [GOOD])
    with pytest.raises(BadRecordError, match=rf"^{tmp_path / 'a_train.jsonl'}: no record in this file \(empty\)"):
        load_records(_cfg(tmp_path))
    records = load_records(_cfg(tmp_path, on_bad_record="skip"))
    assert len(records) == 1 and records.skipped_bad == 1


def test_csv_non_utf8_line_names_its_line(tmp_path):
    path = tmp_path / "train.csv"
    path.write_bytes(b"text\nfine\ncaf\xe9\n")
    with pytest.raises(BadRecordError, match=rf"^{path}:3: not UTF-8"):
        load_records(_cfg(path, source="csv"))
    records = load_records(_cfg(path, source="csv", on_bad_record="skip"))
    assert [r["text"] for r in records] == ["fine"] and records.skipped_bad == 1


def test_unknown_chat_role_names_file_and_line_and_skips_are_in_the_stats(tmp_path, tokenizer):
    path = tmp_path / "chat.jsonl"
    typo = {"messages": [{"role": "user", "content": "hi"}, {"role": "asistant", "content": "hello"}]}
    _write_jsonl(path, [CHAT, typo, CHAT, b"not json"])
    with pytest.raises(BadRecordError, match=rf"^{path}:4: not valid JSON"):
        load_records(_cfg(path))
    records = load_records(_cfg(path, on_bad_record="skip"))
    with pytest.raises(BadRecordError, match=rf"^{path}:2: unknown chat role 'asistant' \(known: system, user"):
        render_records(records, tokenizer, _cfg(path), max_length=512)
    ds = render_records(records, tokenizer, _cfg(path, on_bad_record="skip"), max_length=512)
    assert len(ds) == 2 and ds.stats.dropped_bad == 2  # the bad JSON line and the unknown role
    assert ds.stats.skipped() == 2


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_over_long_example_follows_the_rule_and_is_counted(tmp_path, tokenizer, overlong):
    path = tmp_path / "docs.jsonl"
    _write_jsonl(path, [GOOD, {"text": " ".join(["word"] * 200)}])
    ds = render_records(load_records(_cfg(path)), tokenizer, _cfg(path, overlong=overlong), max_length=32)
    if overlong == "truncate":
        assert len(ds) == 2 and ds.stats.truncated == 1 and ds.lengths.max() == 32
    else:
        assert len(ds) == 1 and ds.stats.dropped_overlong == 1


def test_dailydialog_text_non_utf8_line_names_its_line(tmp_path):
    path = tmp_path / "dialogues_text.txt"
    path.write_bytes(b"Hi . __eou__ Hello . __eou__\nCaf\xe9 ? __eou__ Yes . __eou__\nBye . __eou__ Bye . __eou__\n")
    with pytest.raises(BadRecordError, match=rf"^{path}:2: not UTF-8"):
        load_records(_cfg(path, source="dailydialog"))
    records = load_records(_cfg(path, source="dailydialog", on_bad_record="skip"))
    assert len(records) == 2 and records.skipped_bad == 1
