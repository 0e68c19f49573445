"""Issue 14, bullet 5: failures that used to escape as tracebacks end in one line. A full disk during a
checkpoint save (DCP raises ``CheckpointException``, a ``BaseException``); CSV with a UTF-8 byte-order mark,
CSV cells over Python's 128 KiB default, JSON nested 100k deep and a corrupt Parquet file, each named by
file (and line) and following ``data.on_bad_record``."""

from __future__ import annotations

import errno
import json

import pytest
from torch.distributed.checkpoint import FileSystemWriter

from tests.unit.test_checkpoint import make_state
from trainer.checkpoint import Checkpointer, CheckpointError
from trainer.config import CheckpointConfig, DataConfig
from trainer.data import load_records, tables
from trainer.data.bad_records import BadRecordError
from trainer.guard import describe_failure

DEEP = "[" * 100_000 + "]" * 100_000


def test_a_full_disk_during_save_is_one_line(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    with pytest.raises(CheckpointError) as info:
        Checkpointer(CheckpointConfig(), tmp_path).save(3, make_state(), tokens_seen=3, total_steps=10)
    message = str(info.value)
    assert "\n" not in message and "failed on rank 0: OSError: [Errno 28] No space left on device" in message
    line = str(describe_failure(info.value, "step 3", 600))
    assert line.startswith("rank 0: CheckpointError at step 3: saving checkpoint") and "\n" not in line


def load(path, source: str, mode: str = "error", **kw):
    return load_records(DataConfig(source=source, path=str(path), on_bad_record=mode, **kw))


def test_csv_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbftext,id\r\nhello there,1\r\n")
    assert [r["text"] for r in load(path, "csv")] == ["hello there"]


def test_a_big_csv_cell_is_read_and_a_row_over_the_limit_is_a_bad_record(tmp_path, monkeypatch):
    path = tmp_path / "big.csv"
    big = "word " * 40_000  # 200 KB: over Python's default field limit of 128 KiB
    path.write_text(f'text\nshort one\n"{big}"\nlast\n')
    assert [len(r["text"]) for r in load(path, "csv")] == [9, len(big), 4]
    monkeypatch.setattr(tables, "CSV_FIELD_LIMIT", 1000)  # the same path for a cell over our own limit
    with pytest.raises(BadRecordError, match=rf"^{path}:3: not a valid CSV row \(field larger than field limit"):
        load(path, "csv")
    assert [r["text"] for r in load(path, "csv", "skip")] == ["short one", "last"]


def test_json_nested_100k_deep_is_a_bad_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": ' + DEEP + "}\n")
    with pytest.raises(BadRecordError, match=rf"^{path}:2: not readable JSON \(JSON nested too deeply"):
        load(path, "jsonl")
    assert [r["text"] for r in load(path, "jsonl", "skip")] == ["fine"]
    cell = tmp_path / "deep.csv"
    cell.write_text(f'messages\n"{DEEP}"\n')
    with pytest.raises(BadRecordError, match=rf"^{cell}:2: the messages cell is not readable JSON"):
        load(cell, "csv")


def test_a_corrupt_parquet_file_is_named_and_can_be_skipped(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["good row"]}), tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_bytes(b"PAR1 this is not parquet at all PAR1")
    with pytest.raises(BadRecordError, match=rf"^{tmp_path / 'b.parquet'}: not a readable Parquet file"):
        load(tmp_path, "parquet")
    records = load(tmp_path, "parquet", "skip")
    assert [r["text"] for r in records] == ["good row"] and records.skipped_bad == 1
    with pytest.raises(BadRecordError, match="b.parquet: not a readable Parquet file"):
        load(tmp_path / "b.parquet", "dailydialog")
