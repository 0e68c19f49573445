"""Issue 33, cases 6, 8 and 9: every bad input is one line naming its file and line (or setting), or a counted
skip naming every reason; input memory is bounded; many small files are read in one pass. In-process, each
through the route a run takes (the tokenizer's sample, the data cache's ``datasets`` route)."""

from __future__ import annotations

import json
import logging

import pytest

from tests.conftest import compose_job
from trainer.config import ConfigError, DataConfig
from trainer.data import load_dataset
from trainer.data.bad_records import BadRecordError
from trainer.data.chat import ChatTemplateError, chat_segments_batch
from trainer.data.tokenizer import bpe_sample, sample_records
from trainer.guard import describe_failure

CHAT = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello, friend"}]}
PAIR = {"prompt": "say hi", "chosen": "hello there", "rejected": "go away"}


def _jsonl(path, lines: list):
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    return path


def _cfg(path, tmp_path, **kw) -> DataConfig:
    return DataConfig(source="jsonl", path=str(path), cache_dir=str(tmp_path / "cache"), **kw)


@pytest.mark.parametrize(
    "good, bad_line",
    [
        (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe hi"}, {"role": "assistant", "content": "x"}]}'),
        (PAIR, b'{"prompt": "\xff\xfe", "chosen": "a", "rejected": "b"}'),
    ],
    ids=["sft", "dpo"],
)
def test_bytes_that_are_not_utf8_name_their_line_or_are_a_counted_skip(tmp_path, tokenizer, good, bad_line):
    """Case 6: pyarrow's JSON reader keeps the bytes, reading the row failed later (a UnicodeDecodeError
    traceback at setup, in the tokenizer's sample and the cache alike, also under on_bad_record=skip)."""
    path = _jsonl(tmp_path / "train.jsonl", [good, good, bad_line, good])
    for read in (lambda cfg: list(sample_records(cfg, 10)), lambda cfg: load_dataset(cfg, tokenizer, 256)):
        with pytest.raises(BadRecordError, match=rf"^{path}:3: not UTF-8 \(byte 0xff"):
            read(_cfg(path, tmp_path))
    skip = _cfg(path, tmp_path, on_bad_record="skip")
    assert len(list(sample_records(skip, 10))) == 3
    assert load_dataset(skip, tokenizer, 256).stats.dropped_bad == 1


def test_a_file_whose_every_record_is_skipped_names_every_reason(tmp_path, tokenizer):
    """Case 8: the error counted records, empty, over-long and label-less ones, but not the 20 bad lines."""
    path = _jsonl(tmp_path / "train.jsonl", [b"not json %d" % i for i in range(20)])
    with pytest.raises(
        BadRecordError,
        match=r"no usable example \(0 records read; left out: 0 empty, 0 over-long, "
        r"0 with no label token, 20 bad, 0 over data.max_record_bytes\)",
    ) as info:
        load_dataset(_cfg(path, tmp_path, on_bad_record="skip"), tokenizer, 256)
    failure = describe_failure(info.value, "setup", 600)
    assert failure.exit_code == 2 and str(failure).startswith("data error: data.source=jsonl: no usable example")


def test_a_chat_template_the_jinja_sandbox_blocks_is_one_line(tokenizer):
    """Case 8: a SecurityError traceback; now a setting error saying nothing unsafe ran (exit code 2)."""
    for template in (
        "{{ messages.__class__.__mro__ }}",
        "{% for m in messages %}{{ m.content }}{% endfor %}{{ messages.append(1) }}",
    ):
        with pytest.raises(ChatTemplateError, match="blocked by the Jinja sandbox .*nothing unsafe ran") as info:
            chat_segments_batch([CHAT["messages"]], tokenizer, template, "responses")
        assert describe_failure(info.value, "setup", 600).exit_code == 2
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        chat_segments_batch([CHAT["messages"]], tokenizer, "{% for m in messages %}", "responses")


def test_packfsdp_cache_pointing_at_a_file_is_one_line(tmp_path, monkeypatch):
    """Case 8: a NotADirectoryError traceback from the tokenizer's lock folder."""
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=rf"^PACKFSDP_CACHE={tmp_path / 'file'} is a file, not a folder"):
        compose_job(["recipe=cpu_dailydialog"])
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^data.cache_dir={tmp_path / 'file' / 'sub'} is inside"):
        compose_job(["recipe=cpu_dailydialog", f"data.cache_dir={tmp_path / 'file' / 'sub'}"])


def test_a_record_over_the_size_limit_is_skipped_before_it_is_tokenized_or_sampled(
    tmp_path, tokenizer, caplog, monkeypatch
):
    """Case 9: one 200 MB line grew rank 0 past 11 GB (the tokenizer trained on it, then it was tokenized)."""
    from trainer.data import render

    huge = {"text": "word " * 40_000}  # 200 kB, over the 100 kB limit set here
    path = _jsonl(tmp_path / "train.jsonl", [{"text": "a short document"}] * 5 + [huge] + [{"text": "another one"}] * 5)
    cfg = _cfg(path, tmp_path, max_record_bytes=100_000)
    assert [r["text"] for r in bpe_sample(cfg)].count(huge["text"]) == 0
    longest = []
    encode = render.encode_pieces
    monkeypatch.setattr(
        render, "encode_pieces", lambda tok, texts: longest.append(max(map(len, texts))) or encode(tok, texts)
    )
    with caplog.at_level(logging.WARNING):
        ds = load_dataset(cfg, tokenizer, 256)
    assert max(longest) < 100 and len(ds) == 10 and ds.stats.dropped_oversize == 1
    assert f"skipped record at {path}:6: 200,004 bytes, over data.max_record_bytes=100,000" in caplog.text
    assert "1 over data.max_record_bytes" in caplog.text  # the run's data summary counts it


def test_many_small_files_are_read_in_one_pass(tmp_path, tokenizer, monkeypatch):
    """Case 9: one ``datasets`` load per file (4,745 of 10,000 tiny files read in 150 s). A bad line among
    them is still named by file and line."""
    import datasets

    folder = tmp_path / "shards"
    folder.mkdir()
    for i in range(300):
        _jsonl(folder / f"part{i:04d}.jsonl", [{"text": f"document number {i}"}])
    _jsonl(folder / "part0150.jsonl", [{"text": "document number 150"}, b"{oops"])
    loads = []
    load = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: loads.append(a) or load(*a, **k))
    for read in (lambda cfg: list(sample_records(cfg, 1000)), lambda cfg: load_dataset(cfg, tokenizer, 256)):
        with pytest.raises(BadRecordError, match=rf"^{folder / 'part0150.jsonl'}:2: not valid JSON"):
            read(_cfg(folder, tmp_path))
    skip = _cfg(folder, tmp_path, on_bad_record="skip")
    assert len(list(sample_records(skip, 1000))) == 300
    ds = load_dataset(skip, tokenizer, 256)
    assert len(ds) == 300 and ds.stats.dropped_bad == 1 and loads == []
