"""Pre-tokenized data (``input_ids`` + ``labels`` / ``loss_mask`` / ``attention_mask``) from JSONL, Parquet,
Arrow and ``save_to_disk`` folders: validated, and packed exactly like the same examples given as text."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from tests.data_oracle import render_records
from trainer.config import ConfigError, DataConfig, JobConfig, ModelConfig
from trainer.data import load_tokenizer
from trainer.data.bad_records import BadRecordError
from trainer.data.pretokenized import token_segments
from trainer.data.sources import load_records
from trainer.data.tables import detect_columns
from trainer.pipeline import build_training_data


@pytest.fixture(scope="module")
def chat_tokenizer(cache_dir):
    chats = DataConfig(source="chat_synthetic", num_records=60, cache_dir=cache_dir)
    return load_tokenizer(ModelConfig(chat_template="chatml", tokenizer_vocab_size=512), chats)


@pytest.fixture(scope="module")
def text_dataset(chat_tokenizer, cache_dir):
    cfg = DataConfig(source="chat_synthetic", num_records=60, cache_dir=cache_dir)
    return render_records(load_records(cfg), chat_tokenizer, cfg, max_length=512)


def ids_rows(ds, style: str) -> list[dict]:
    """The dataset's examples as pre-tokenized rows in one of the accepted styles."""
    rows = []
    for i in range(len(ds)):
        ids, mask = (a.tolist() for a in ds.example(i))
        if style == "labels":
            rows.append({"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask, strict=True)]})
        elif style == "loss_mask":
            rows.append({"input_ids": ids, "loss_mask": [int(m) for m in mask]})
        else:  # right-padded to a common width, as a tokenizer's batch call leaves them
            pad = 8 + i % 3
            rows.append(
                {
                    "input_ids": ids + [0] * pad,
                    "labels": [t if m else -100 for t, m in zip(ids, mask, strict=True)] + [-100] * pad,
                    "attention_mask": [1] * len(ids) + [0] * pad,
                }
            )
    return rows


def write_rows(rows: list[dict], path, kind: str) -> str:
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:  # a save_to_disk folder
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def same(a, b) -> bool:
    return all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("tokens", "loss_mask", "offsets"))


@pytest.mark.parametrize(
    "kind,source,style",
    [
        ("jsonl", "jsonl", "labels"),
        ("parquet", "parquet", "loss_mask"),
        ("arrow", "hf", "padded"),
    ],
)
def test_ids_give_the_same_examples_as_their_text(
    tmp_path, chat_tokenizer, text_dataset, kind, source, style, cache_dir
):
    path = write_rows(ids_rows(text_dataset, style), tmp_path / f"data.{kind}", kind)
    cfg = DataConfig(source=source, path=path, cache_dir=cache_dir)
    ids_dataset = render_records(load_records(cfg), chat_tokenizer, cfg, max_length=512)
    assert same(ids_dataset, text_dataset)
    assert ids_dataset.stats.label_tokens == text_dataset.stats.label_tokens > 0


def test_ids_and_text_give_the_same_batches(tmp_path, chat_tokenizer, text_dataset, cache_dir):
    """Through the whole pipeline (cache, held-out split, sampler, collate): the same micro-batches."""
    path = write_rows(ids_rows(text_dataset, "labels"), tmp_path / "data.parquet", "parquet")
    jobs = [
        JobConfig(data=DataConfig(source="chat_synthetic", num_records=60, cache_dir=cache_dir)),
        JobConfig(data=DataConfig(source="parquet", path=path, cache_dir=cache_dir)),
    ]
    data = [build_training_data(job, tokenizer=chat_tokenizer, context=512) for job in jobs]
    assert same(data[0].dataset, data[1].dataset)
    for _ in range(5):
        (_, a, _), (_, b, _) = data[0].sampler.next_microbatch(), data[1].sampler.next_microbatch()
        batch_a, batch_b = data[0].collate(data[0].dataset, a), data[1].collate(data[1].dataset, b)
        for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
            assert torch.equal(getattr(batch_a, name), getattr(batch_b, name))


@pytest.mark.parametrize(
    "row,message",
    [
        ({"input_ids": [1, 2, 999_999]}, "outside the tokenizer's vocabulary"),
        ({"input_ids": [1, 2, 3], "labels": [1, 2]}, "labels has 2 values but input_ids has 3"),
        ({"input_ids": [5, 6, 7], "labels": [6, 7, -100]}, "look shifted by one"),
        ({"input_ids": [5, 6, 7], "labels": [-100, 9, 7]}, "labels[1]=9 but input_ids[1]=6"),
        ({"input_ids": [5, 6, 7], "attention_mask": [1, 0, 1]}, "0s between tokens"),
        ({"input_ids": "5 6 7"}, "must be a list of integers"),
        ({"input_ids": [5, 6.5]}, "integers only"),
    ],
)
def test_a_bad_row_names_its_file_and_line(tmp_path, chat_tokenizer, row, message, cache_dir):
    good = {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "attention_mask": [1, 1, 1, 1]}
    good = {k: good[k] for k in row}  # the same columns as the bad row (every row needs the detected ones)
    path = write_rows([good, row, good], tmp_path / "ids.jsonl", "jsonl")
    cfg = DataConfig(source="jsonl", path=path, cache_dir=cache_dir)
    with pytest.raises(BadRecordError, match=rf"ids.jsonl:2: .*{re.escape(message)}"):
        render_records(load_records(cfg), chat_tokenizer, cfg, max_length=64)
    skipped = render_records(
        load_records(cfg),
        chat_tokenizer,
        DataConfig(source="jsonl", path=path, on_bad_record="skip", cache_dir=cache_dir),
        max_length=64,
    )
    assert skipped.stats.dropped_bad == 1 and len(skipped) == 2  # counted, never silently dropped


def test_loss_comes_from_labels_or_mask_and_loss_on_all_takes_every_token():
    ids = [4, 5, 6, 7]

    def as_mask(segs):
        return [s.loss for s in segs for _ in s.text]

    assert as_mask(token_segments({"input_ids": ids, "labels": [-100, -100, 6, 7]}, 10, "auto", "x")) == [0, 0, 1, 1]
    assert as_mask(token_segments({"input_ids": ids, "loss_mask": [0, 1, 1, 0]}, 10, "auto", "x")) == [0, 1, 1, 0]
    assert as_mask(token_segments({"input_ids": ids}, 10, "auto", "x")) == [1, 1, 1, 1]
    assert as_mask(token_segments({"input_ids": ids, "labels": [-100] * 4}, 10, "all", "x")) == [1, 1, 1, 1]
    assert token_segments({"input_ids": [0, 0], "attention_mask": [0, 0]}, 10, "auto", "x") is None  # empty: counted


def test_columns_are_detected_and_a_local_tokenizer_is_refused(tmp_path, cache_dir):
    assert detect_columns(["input_ids", "labels", "extra"]) == {"input_ids": "input_ids", "labels": "labels"}
    assert detect_columns(["attention_mask", "input_ids"]) == {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
    }
    path = write_rows([{"input_ids": [1, 2, 3]}], tmp_path / "ids.jsonl", "jsonl")
    with pytest.raises(ConfigError, match="pre-tokenized .* model.tokenizer=DIR_OR_HUB_ID"):
        load_tokenizer(
            ModelConfig(tokenizer_vocab_size=300), DataConfig(source="jsonl", path=path, cache_dir=cache_dir)
        )


def test_one_float_row_is_named_alone_on_the_cached_route(tmp_path, chat_tokenizer, cache_dir):
    """One float id row types the whole column float in Arrow; the cached route reads such a file line by
    line, so the error names that row's line and a skip drops that row only (not all of them)."""
    from trainer.data.cache import build_dataset

    rows = [{"input_ids": [5, 6, 7, 8 + i % 5]} for i in range(60)]
    rows[29] = {"input_ids": [5, 6.5, 7]}
    path = write_rows(rows, tmp_path / "ids.jsonl", "jsonl")
    cfg = DataConfig(source="jsonl", path=path, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(BadRecordError, match=r"ids.jsonl:30: .*integers only"):
        build_dataset(chat_tokenizer, cfg, 64, "float-row")
    skip = DataConfig(source="jsonl", path=path, cache_dir=str(tmp_path / "cache"), on_bad_record="skip")
    ds = build_dataset(chat_tokenizer, skip, 64, "float-row-skip")
    assert len(ds) == 59 and ds.stats.dropped_bad == 1
