"""``data.source=chitchat`` on a small file of the package's shape (the 39 MB corpus itself is never read here):
conversation -> turns of alternating speakers, joins, skips, the held-out split, determinism, the missing extra."""

from __future__ import annotations

import json
import logging
import types

import numpy as np
import pytest

import trainer.data.chitchat as chitchat
from trainer.config import ConfigError, DataConfig
from trainer.data import load_dataset, load_records
from trainer.data.bad_records import BadRecordError
from trainer.data.holdout import split_holdout
from trainer.data.sources import source_fingerprint


def message(sender: str, text: str) -> dict:
    return {"text": text, "sender": sender, "timestamp": "2018-05-02T19:38:15Z"}


CORPUS = {
    "c1": {
        "prompt": "What is your favorite smell?",
        "ratings": {"witty": 5},
        "start": "2018-05-02T19:38:00Z",
        "messages": [
            [message("a", "Hello"), message("a", " How are you? ")],
            [message("b", "good"), message("b", ""), message("b", "you?")],
            [message("a", "Fine.")],
            [message("a", "Bye!")],
        ],
    },  # a's turn split over two turns in the file: one turn
    "c0": {"messages": [[message("b", "anyone here?")]]},  # one speaker, no reply: a single turn
    "c2": {"messages": [[message("a", "  ")], [message("b", "")]]},  # no text at all: the renderer's empty skip
    "c3": {"messages": [[message("a", "hi")], [message("b", "hey")], [message("a", "ok")]]},
}
TURNS = [["Hello\nHow are you?", "good\nyou?", "Fine.\nBye!"], ["anyone here?"], [], ["hi", "hey", "ok"]]


def write_corpus(tmp_path, corpus: dict, name: str = "dataset.json"):
    path = tmp_path / name
    path.write_text(json.dumps(corpus))
    return path


def cfg_for(path, tmp_path, **overrides) -> DataConfig:
    return DataConfig(source="chitchat", path=str(path), cache_dir=str(tmp_path / "cache"), **overrides)


def test_a_conversation_becomes_turns_of_alternating_speakers_in_file_order(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        records = load_records(cfg_for(write_corpus(tmp_path, CORPUS), tmp_path))
    assert [r["turns"] for r in records] == TURNS
    assert "4 conversations read" in caplog.text and "1 with one speaker only" in caplog.text
    assert "3 empty messages left out" in caplog.text
    assert chitchat.speaker_turns([("a", "x"), ("b", " "), ("a", "y"), ("b", "z")]) == (["x\ny", "z"], 1)


def test_lengths_skips_and_held_out_split_as_for_every_source(tmp_path, tokenizer, caplog):
    cfg = cfg_for(write_corpus(tmp_path, CORPUS), tmp_path, overlong="truncate")
    with caplog.at_level(logging.WARNING):
        ds = load_dataset(cfg, tokenizer, max_length=16)
    assert ds.stats.records == 4 and ds.stats.dropped_empty == 1 and len(ds) == 3
    assert ds.stats.truncated == 1 and ds.lengths.max() == 16  # c1 is longer than 16 tokens, c0 and c3 shorter
    assert "skipped 1 empty" in caplog.text
    (tmp_path / "copy").mkdir()
    again = load_dataset(cfg_for(write_corpus(tmp_path / "copy", CORPUS), tmp_path / "copy"), tokenizer, 16)
    assert np.array_equal(ds.tokens, again.tokens) and np.array_equal(ds.lengths, again.lengths)  # deterministic
    train, held = split_holdout(ds, 0.5, seed=3)
    train_again, held_again = split_holdout(again, 0.5, seed=3)
    assert held is not None and len(train) + len(held) == len(ds)
    assert np.array_equal(train.rows, train_again.rows) and np.array_equal(held.rows, held_again.rows)
    assert not set(train.rows.tolist()) & set(held.rows.tolist())


@pytest.mark.parametrize(
    "conversation, reason",
    [
        ({"turns": []}, "a conversation needs a 'messages' list"),
        ({"messages": [{"text": "hi"}]}, "turn 0 is not a list"),
        ({"messages": [[{"text": "hi"}]]}, "turn 0 message 0 needs a string 'text' and 'sender'"),
        ({"messages": [[message("a", "hi")], [{"text": None, "sender": "b"}]]}, "turn 1 message 0"),
    ],
)
def test_a_malformed_conversation_is_named_or_skipped_counted(tmp_path, caplog, conversation, reason):
    path = write_corpus(tmp_path, {"good": CORPUS["c3"], "bad": conversation})
    with pytest.raises(BadRecordError, match=f"{path} conversation bad: {reason}"):
        load_records(cfg_for(path, tmp_path))
    with caplog.at_level(logging.WARNING):
        records = load_records(cfg_for(path, tmp_path, on_bad_record="skip"))
    assert [r["turns"] for r in records] == [TURNS[3]] and records.skipped_bad == 1
    assert "skipped 1 bad input(s): 1 conversation(s)" in caplog.text


@pytest.mark.parametrize(
    "text, reason", [("[1, 2]", "expected an object of id -> conversation"), ("{not json", "not a chit-chat JSON file")]
)
def test_a_file_that_is_not_the_corpus_is_named(tmp_path, text, reason):
    path = tmp_path / "dataset.json"
    path.write_text(text)
    with pytest.raises(BadRecordError, match=reason):
        load_records(cfg_for(path, tmp_path))


def test_the_installed_package_is_read_in_place_and_joins_the_cache_key(tmp_path, monkeypatch):
    package = tmp_path / "site" / "chitchat_dataset"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise AssertionError('the package is read, never imported')\n")
    data = write_corpus(package, CORPUS)
    spec = types.SimpleNamespace(origin=str(package / "__init__.py"))
    monkeypatch.setattr(chitchat.importlib.util, "find_spec", lambda name: spec if name == "chitchat_dataset" else None)
    cfg = DataConfig(source="chitchat", cache_dir=str(tmp_path / "cache"))
    assert [r["turns"] for r in load_records(cfg)] == TURNS
    before = source_fingerprint(cfg)
    assert str(data) in before
    write_corpus(package, {"c3": CORPUS["c3"]})
    assert source_fingerprint(cfg) != before  # another corpus (a new package version): a new cache entry


def test_without_the_package_one_line_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setattr(chitchat.importlib.util, "find_spec", lambda name: None)
    for step in (load_records, source_fingerprint):
        with pytest.raises(ConfigError) as e:
            step(DataConfig(source="chitchat"))
        assert "pip install -e '.[chitchat]'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="no such file"):
        load_records(DataConfig(source="chitchat", path=str(tmp_path / "missing.json")))


def test_the_installed_corpus_is_found_when_the_extra_is_installed():
    """Located only (the 39 MB file is read by the main job, not here)."""
    if chitchat.importlib.util.find_spec("chitchat_dataset") is None:
        pytest.skip("the chitchat extra is not installed (bash launch/setup_env.sh installs it)")
    path = chitchat.chitchat_file(None)
    assert path.name == "dataset.json" and path.stat().st_size > 30_000_000
