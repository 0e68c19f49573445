"""The cache sink's table path (``trainer.data.cache``): table files read by ``datasets``, rendered by a ``map``,
stored as memory-mapped ``.npy`` arrays; the same examples, masks and counts as rendering the records in memory."""

from __future__ import annotations

import json
import logging
from itertools import pairwise

import numpy as np
import pytest

import trainer.data.cache as engine
from tests.data_oracle import render_records
from trainer.config import DataConfig, MixtureConfig
from trainer.data import load_dataset, load_records
from trainer.data.bad_records import BadRecordError

CHAT = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello, how are you?"}]}
LONG = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 300}]}
EMPTY = {"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": ""}]}


def write_jsonl(path, rows: list) -> str:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return str(path)


def chats(n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"question {i} about the weather"},
                {"role": "assistant", "content": "it is sunny " * (1 + i % 7)},
            ]
        }
        for i in range(n)
    ]


def same_examples(a, b) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x, y) for i in range(len(a)) for x, y in zip(a.example(i), b.example(i), strict=True)
    )


def test_table_file_gives_the_records_path_examples_memory_mapped(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chats.jsonl", chats(30) + [LONG, EMPTY, CHAT])
    cfg = DataConfig(source="jsonl", path=path, cache_dir=str(tmp_path / "cache"), max_length=64)
    ds = load_dataset(cfg, tokenizer, max_length=64)
    reference = render_records(load_records(cfg), tokenizer, cfg, max_length=64)
    assert same_examples(ds, reference)
    assert ds.stats == reference.stats and ds.stats.truncated == 1 and ds.stats.dropped_empty == 1
    assert isinstance(ds.tokens, np.memmap) and isinstance(ds.loss_mask, np.memmap)
    assert np.array_equal(ds.lengths, reference.lengths)
    assert np.array_equal(ds.label_counts(), reference.label_counts())
    limited = load_dataset(DataConfig(**{**cfg.__dict__, "limit": 5}), tokenizer, max_length=64)
    assert limited.stats.records == 5 and same_examples(limited, reference.select(np.arange(5)))


def test_select_is_a_view_of_the_same_arrays(small_dataset):
    picked = small_dataset.select(np.array([5, 2, 9]))
    again = picked.select(np.array([2, 0]))
    assert again.tokens is small_dataset.tokens and len(again) == 2
    assert np.array_equal(again.example(0)[0], small_dataset.example(9)[0])
    assert np.array_equal(again.lengths, small_dataset.lengths[[9, 5]])
    assert np.array_equal(again.label_counts(), small_dataset.label_counts()[[9, 5]])


@pytest.mark.slow
def test_map_workers_give_the_same_arrays(tmp_path, tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "chats.jsonl", chats(2500))
    one = load_dataset(DataConfig(source="jsonl", path=path, cache_dir=str(tmp_path / "a"), num_proc=1), tokenizer, 128)
    monkeypatch.setattr(engine, "SINGLE_PROCESS_BELOW", 0)
    two = load_dataset(DataConfig(source="jsonl", path=path, cache_dir=str(tmp_path / "b"), num_proc=2), tokenizer, 128)
    assert same_examples(one, two) and one.stats == two.stats


def test_a_bad_row_found_in_the_map_names_its_file_and_line(tmp_path, tokenizer, caplog):
    bad_role = {"messages": [{"role": "asistant", "content": "typo"}]}
    path = write_jsonl(tmp_path / "chats.jsonl", [CHAT, "\n", CHAT, bad_role, CHAT])
    cfg = DataConfig(source="jsonl", path=path, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(BadRecordError, match=f"{path}:4: unknown chat role 'asistant'"):
        load_dataset(cfg, tokenizer, max_length=64)
    assert not list((tmp_path / "cache" / "datasets").glob("*"))  # nothing half-written left behind
    with caplog.at_level(logging.WARNING):
        ds = load_dataset(DataConfig(**{**cfg.__dict__, "on_bad_record": "skip"}), tokenizer, max_length=64)
    assert len(ds) == 3 and ds.stats.dropped_bad == 1 and ds.stats.records == 4
    assert f"{path}:4" in caplog.text


def test_a_file_datasets_refuses_is_read_line_by_line(tmp_path, tokenizer, caplog):
    path = write_jsonl(tmp_path / "chats.jsonl", [CHAT, '{"messages": [unterminated\n', CHAT])
    cfg = DataConfig(source="jsonl", path=path, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(BadRecordError, match=f"{path}:2: not valid JSON"):
        load_dataset(cfg, tokenizer, max_length=64)
    with caplog.at_level(logging.WARNING):
        ds = load_dataset(DataConfig(**{**cfg.__dict__, "on_bad_record": "skip"}), tokenizer, max_length=64)
    assert len(ds) == 2 and ds.stats.dropped_bad == 1 and f"{path}:2" in caplog.text


def test_batched_chat_rendering_equals_apply_chat_template(tokenizer):
    from trainer.data.chat import CHATML_TEMPLATE, chat_segments_batch

    conversations = [c["messages"] for c in chats(5)] + [
        [{"role": "system", "content": "be brief"}] + CHAT["messages"],
        [{"role": "assistant", "content": "I start."}],
    ]
    fast = chat_segments_batch(conversations, tokenizer, CHATML_TEMPLATE, "auto")
    with_extra_key = [[dict(m, name=None) for m in c] for c in conversations]  # not plain: apply_chat_template
    assert chat_segments_batch(with_extra_key, tokenizer, CHATML_TEMPLATE, "auto") == fast


def mix_cfg(tmp_path, by="examples", seed=0) -> DataConfig:
    return DataConfig(
        cache_dir=str(tmp_path),
        seed=seed,
        mixture=MixtureConfig(
            by=by,
            sources=[
                {"source": "dailydialog_synthetic", "num_records": 40, "weight": 1.0},
                {"source": "chat_synthetic", "num_records": 120, "weight": 1.0},
            ],
        ),
    )


def test_mixture_shares_by_examples_and_tokens_deterministic_by_seed(tmp_path, tokenizer):
    from trainer.data.holdout import split_holdout

    ds = load_dataset(mix_cfg(tmp_path), tokenizer, max_length=256)
    shares = ds.shares()
    assert [s["examples"] for s in shares] == [80, 80] and shares[0]["unique_examples"] == 40  # 40 repeated twice
    again = load_dataset(mix_cfg(tmp_path), tokenizer, max_length=256)
    other_seed = load_dataset(mix_cfg(tmp_path, seed=1), tokenizer, max_length=256)
    assert np.array_equal(ds.row, again.row) and not np.array_equal(ds.row, other_seed.row)
    by_tokens = load_dataset(mix_cfg(tmp_path, by="tokens"), tokenizer, max_length=256).shares()
    assert all(abs(s["token_share"] - 0.5) < 0.05 for s in by_tokens)
    train, held = split_holdout(ds, 0.2, seed=3)
    assert len(train) + len(held) == len(ds)
    sides = [{(int(p), int(r)) for p, r in zip(part.part, part.row, strict=True)} for part in (train, held)]
    assert not sides[0] & sides[1]  # a repeated example never straddles the split
    assert np.array_equal(np.sort(np.concatenate([train.lengths, held.lengths])), np.sort(ds.lengths))


def test_analyze_reports_the_mixture(tmp_path, cache_dir):
    from trainer.tools import analyze

    overrides = [
        "recipe=cpu_dailydialog",
        f"data.cache_dir={cache_dir}",
        f"output_root={tmp_path}",
        "data.mixture.sources=[{source: dailydialog_synthetic, num_records: 60, weight: 3}, "
        "{source: chat_synthetic, num_records: 60, weight: 1}]",
        "--world-sizes",
        "2",
    ]
    figures = analyze.run(overrides)
    shares = [s["example_share"] for s in figures["mix"]]
    assert abs(shares[0] - 0.75) < 0.05 and abs(shares[1] - 0.25) < 0.05  # 3:1, the hold-out aside


def test_held_out_draw_is_computed_once_per_cache(tmp_path, tokenizer, monkeypatch):
    import trainer.data.examples as dataset_module
    from trainer.data.holdout import holdout_mask

    cfg = DataConfig(num_records=60, cache_dir=str(tmp_path))
    ds = load_dataset(cfg, tokenizer, max_length=256)
    held = holdout_mask(ds, 0.3, seed=7)
    assert (ds.folder / "content_hashes_7.npy").is_file() and 0 < held.sum() < len(ds)
    monkeypatch.setattr(dataset_module, "example_hashes", lambda *a: pytest.fail("hashed again despite the cache"))
    again = load_dataset(cfg, tokenizer, max_length=256)
    assert np.array_equal(holdout_mask(again, 0.3, seed=7), held)
    view = again.select(np.array([3, 1]))
    assert np.array_equal(holdout_mask(view, 0.3, seed=7), held[[3, 1]])


@pytest.mark.parametrize("kind", ["parquet", "hf"])
def test_parquet_and_saved_datasets_take_the_arrow_path(tmp_path, tokenizer, kind):
    import datasets

    table = datasets.Dataset.from_list(
        [
            {
                "conversations": [
                    {"from": "human", "value": f"q{i}"},
                    {"from": "gpt", "value": "an answer " * (i % 5 + 1)},
                ]
            }
            for i in range(40)
        ]
    )
    path = tmp_path / ("data.parquet" if kind == "parquet" else "saved")
    table.to_parquet(str(path)) if kind == "parquet" else table.save_to_disk(str(path))
    cfg = DataConfig(source=kind, path=str(path), cache_dir=str(tmp_path / "cache"))
    ds = load_dataset(cfg, tokenizer, max_length=128)
    reference = render_records(load_records(cfg), tokenizer, cfg, max_length=128)
    assert isinstance(ds.tokens, np.memmap) and same_examples(ds, reference) and ds.stats == reference.stats


def test_local_bpe_trains_on_an_even_sample_streamed(tmp_path, monkeypatch):
    import trainer.data.tokenizer as tokenizer_module
    from trainer.config import ModelConfig
    from trainer.data import load_tokenizer
    from trainer.data.tokenizer import sample_records

    path = write_jsonl(tmp_path / "chats.jsonl", chats(50))
    cfg = DataConfig(source="jsonl", path=path, cache_dir=str(tmp_path / "cache"))
    picked = [r["messages"][0]["content"] for r in sample_records(cfg, 5)]
    assert picked == [f"question {i} about the weather" for i in (0, 12, 24, 36, 49)]  # spread evenly, in order
    limited = [r["messages"][0]["content"] for r in sample_records(DataConfig(**{**cfg.__dict__, "limit": 10}), 3)]
    assert limited == [f"question {i} about the weather" for i in (0, 4, 9)]
    seen = []
    real_train = tokenizer_module.train_bpe_tokenizer

    def train(texts, *args):
        assert not isinstance(texts, list)  # streamed into the trainer, never held together
        seen.append(list(texts))
        return real_train(seen[-1], *args)

    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer", train)
    monkeypatch.setattr(tokenizer_module, "BPE_SAMPLE_RECORDS", 5)
    load_tokenizer(ModelConfig(tokenizer_vocab_size=300), cfg)
    assert len(seen) == 1 and len(seen[0]) == 5 * 4  # 5 records x (role, content) of 2 messages


def test_csv_takes_the_arrow_path_and_names_a_bad_row_by_line(tmp_path, tokenizer, monkeypatch):
    import csv as csv_module
    from dataclasses import replace

    from trainer.data.tables import FORMATS

    path = tmp_path / "qa.csv"
    with open(path, "w", newline="") as f:
        writer = csv_module.writer(f)
        writer.writerow(["prompt", "response", "id"])
        writer.writerow(["a question\nover two lines", "an answer", "1"])
        writer.writerow(["", "", "2"])  # empty cells stay "" (an empty chat), not NaN
        writer.writerow(["007", "a number-like cell stays text", "3"])
        writer.writerow(["why?", "because", "4"])
    cfg = DataConfig(source="csv", path=str(path), cache_dir=str(tmp_path / "cache"))
    reference = render_records(load_records(cfg), tokenizer, cfg, max_length=64)
    with monkeypatch.context() as m:  # the line reader is the fallback for files datasets refuses: not this one
        m.setitem(
            FORMATS,
            "csv",
            replace(FORMATS["csv"], read=lambda *a, **k: pytest.fail("csv fell back to the line reader")),
        )
        ds = load_dataset(cfg, tokenizer, max_length=64)
    assert isinstance(ds.tokens, np.memmap) and same_examples(ds, reference) and ds.stats == reference.stats
    assert ds.stats.dropped_empty == 1 and len(ds) == 3
    bad = tmp_path / "chats.csv"
    bad.write_text(
        'messages\n"[{""role"": ""user"", ""content"": ""hi""},\n'  # row 1 spans lines 2-3
        '{""role"": ""assistant"", ""content"": ""yo""}]"\n"[{""role"": ""asistant"", ""content"": ""x""}]"\n'
    )
    bad_cfg = DataConfig(source="csv", path=str(bad), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(BadRecordError, match=f"{bad}:4: unknown chat role 'asistant'"):
        load_dataset(bad_cfg, tokenizer, max_length=64)


def test_example_hashes_are_each_examples_keyed_blake2b():
    """The held-out draw's definition (a faster loop must not move any example across the split)."""
    import hashlib

    from trainer.data.examples import example_hashes

    tokens = np.random.default_rng(0).integers(0, 50_000, size=1000, dtype=np.int32)
    offsets = np.array([0, 0, 3, 400, 401, 1000], dtype=np.int64)  # an empty example too
    for seed in (0, 7, -3):
        expected = [
            int.from_bytes(
                hashlib.blake2b(
                    tokens[lo:hi].tobytes(), digest_size=8, key=seed.to_bytes(8, "little", signed=True)
                ).digest(),
                "little",
            )
            for lo, hi in pairwise(offsets)
        ]
        assert example_hashes(tokens, offsets, seed).tolist() == expected


def test_arrays_are_written_in_place_as_npy_files(tmp_path):
    from trainer.data.arrays import ArrayWriter, open_arrays

    writer = ArrayWriter(tmp_path / "arrays")
    writer.add(np.arange(5, dtype=np.int32), np.array([0, 1, 1, 0, 1], dtype=bool), np.array([2, 3]))
    writer.add(np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(0, np.int64))  # an empty chunk
    writer.finish()
    ds = open_arrays(tmp_path / "arrays")
    assert sorted(p.suffix for p in ds.folder.iterdir()) == [".json"] + [".npy"] * 6  # nothing left over
    assert ds.tokens.tolist() == [0, 1, 2, 3, 4] and ds.offsets.tolist() == [0, 2, 5]
    assert ds.label_counts().tolist() == [1, 1] and ds.stats.label_tokens == 2
