"""Data: the generated corpus matches DailyDialog's statistics; loaders read both real formats; bad input is
counted and logged, never silently dropped."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.data_oracle import render_records
from trainer.config import DataConfig
from trainer.data import load_dataset, load_records
from trainer.data.synthetic import generate_dialogs


def test_synthetic_corpus_matches_dailydialog_statistics(tokenizer):
    dialogs = generate_dialogs(13118, seed=1234)
    assert len(dialogs) == 13118
    turns = np.array([len(d) for d in dialogs])
    assert abs(turns.mean() - 7.9) < 0.15
    assert turns.min() >= 2 and turns.max() >= 25  # long tail
    sample = [t for d in dialogs[:2000] for t in d]
    tokens = np.array([len(ids) for ids in tokenizer(sample, add_special_tokens=False)["input_ids"]])
    assert abs(tokens.mean() - 14.6) < 0.6
    assert tokens.max() > 60  # long tail


def test_synthetic_corpus_is_deterministic_by_seed():
    assert generate_dialogs(50, seed=1) == generate_dialogs(50, seed=1)
    assert generate_dialogs(50, seed=1) != generate_dialogs(50, seed=2)


def test_loss_on_responses_masks_alternate_turns(tokenizer):
    records = [{"turns": ["hello there.", "hi how are you?", "fine thanks."]}]
    ds = render_records(records, tokenizer, DataConfig(loss_on="responses"), max_length=1024)
    tokens, mask = ds.example(0)
    eos = tokenizer.eos_token_id
    turn_ends = np.flatnonzero(tokens == eos)[1:]  # tokens[0] is BOS
    first, second = turn_ends[0], turn_ends[1]
    assert not mask[: first + 1].any()  # turn 1 (and its EOS): no loss
    assert mask[first + 1 : second + 1].all()  # the reply and its EOS: loss
    assert not mask[second + 1 :].any()
    ds_all = render_records(records, tokenizer, DataConfig(loss_on="all"), max_length=1024)
    assert ds_all.label_counts()[0] == len(tokens) - 1


def test_bad_input_is_counted(tokenizer, caplog):
    long_dialog = {"turns": ["word " * 200]}
    records = [{"turns": []}, {"turns": ["ok."]}, long_dialog, {"turns": ["just one turn."]}]
    truncating = render_records(records, tokenizer, DataConfig(overlong="truncate", loss_on="all"), max_length=64)
    assert truncating.stats.dropped_empty == 1 and truncating.stats.truncated == 1
    assert len(truncating) == 3 and truncating.lengths.max() == 64

    dropping = render_records(records, tokenizer, DataConfig(overlong="drop", loss_on="responses"), max_length=64)
    # responses only: single-turn dialogs have no label token and are dropped, counted
    assert dropping.stats.dropped_overlong == 1 and dropping.stats.dropped_no_labels == 2
    assert len(dropping) == 0


def test_empty_dataset_fails_with_a_clear_error(tmp_path, tokenizer):
    path = tmp_path / "dialogues_text.txt"
    path.write_text("\n\n")
    cfg = DataConfig(source="dailydialog", path=str(path), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="no usable example"):
        load_dataset(cfg, tokenizer, max_length=128)


def test_dailydialog_original_text_format(tmp_path, tokenizer, caplog):
    path = tmp_path / "dialogues_text.txt"
    path.write_text(
        "The kitchen stinks . __eou__ I'll throw out the garbage . __eou__\n"
        "So Dick , how about getting some coffee for tonight ? __eou__ Coffee ? I don't honestly like that kind of "
        "stuff . __eou__ Come on , you can at least try a little . __eou__\n"
        "__eou__\n"
    )
    cfg = DataConfig(source="dailydialog", path=str(path), cache_dir=str(tmp_path / "cache"))
    records = load_records(cfg)
    assert [len(r["turns"]) for r in records] == [2, 3, 0]
    assert records[0]["turns"][1] == "I'll throw out the garbage ."
    with caplog.at_level(logging.WARNING):
        ds = load_dataset(cfg, tokenizer, max_length=256)
    assert len(ds) == 2 and ds.stats.dropped_empty == 1
    assert "skipped 1 empty" in caplog.text


def test_dailydialog_parquet_format(tmp_path, tokenizer):
    folder = tmp_path / "daily_dialog" / "data"
    folder.mkdir(parents=True)
    table = pa.table(
        {
            "dialog": [
                ["Hi , how are you ?", "Fine , thanks ."],
                ["Where is the station ?", "Turn left .", "Thanks !"],
            ],
            "act": [[2, 1], [2, 1, 4]],
        }
    )
    pq.write_table(table, folder / "train-00000-of-00001.parquet")
    pq.write_table(table.slice(0, 1), folder / "validation-00000-of-00001.parquet")
    cfg = DataConfig(
        source="dailydialog", path=str(tmp_path / "daily_dialog"), split="train", cache_dir=str(tmp_path / "cache")
    )
    records = load_records(cfg)
    assert [len(r["turns"]) for r in records] == [2, 3]
    assert len(load_dataset(cfg, tokenizer, max_length=256)) == 2
    single = DataConfig(source="dailydialog", path=str(folder / "validation-00000-of-00001.parquet"))
    assert len(load_records(single)) == 1


def test_parquet_without_dialog_column_names_the_file(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["a"]}), path)
    with pytest.raises(ValueError, match="bad.parquet: no 'dialog' column"):
        load_records(DataConfig(source="dailydialog", path=str(path)))


def test_dataset_cache_is_reused(tmp_path, tokenizer, monkeypatch):
    cfg = DataConfig(num_records=20, cache_dir=str(tmp_path))
    first = load_dataset(cfg, tokenizer, max_length=256)
    import trainer.data as data

    monkeypatch.setattr(data, "load_records", lambda cfg: pytest.fail("records re-read despite the cache"))
    second = load_dataset(cfg, tokenizer, max_length=256)
    assert np.array_equal(first.tokens, second.tokens)


def test_each_seed_seeds_one_fact():
    """``data.seed`` picks the records (and keys the cache); ``seed`` and ``eval.holdout_seed`` leave them alone."""
    from dataclasses import replace

    from trainer.config import EvalConfig, JobConfig
    from trainer.data import source_fingerprint

    job = JobConfig(data=DataConfig(num_records=20))
    key = source_fingerprint(job.data)
    for other in (replace(job, seed=job.seed + 1), replace(job, eval=EvalConfig(holdout_seed=5))):
        assert source_fingerprint(other.data) == key
        assert load_records(other.data) == load_records(job.data)
    reseeded = replace(job.data, seed=job.data.seed + 1)
    assert source_fingerprint(reseeded) != key and load_records(reseeded) != load_records(job.data)


def test_the_generated_sources_are_the_configs_list():
    """``trainer.config.GENERATED_SOURCES`` is the one list: the data stage registers exactly those as generated."""
    from trainer.config import GENERATED_SOURCES
    from trainer.data import sources

    decorated = re.findall(r'^@generated_source\("(\w+)"\)$', Path(sources.__file__).read_text(), re.MULTILINE)
    assert sorted(decorated) == sorted(GENERATED_SOURCES) and all(name in sources.SOURCES for name in GENERATED_SOURCES)
    with pytest.raises(ValueError, match="GENERATED_SOURCES"):
        sources.generated_source("my_synthetic")


def test_unigram_entropy_counts_each_label_token_of_the_examples_held():
    """The reference a run's loss goes below: label tokens only (never an example's first), by the examples a
    view or a mixture holds (twice if held twice), a chunk of examples at a time."""
    from trainer.data.examples import from_examples, unigram_entropy
    from trainer.data.mixture import MixtureDataset

    examples = [([5, 1, 2, 2], [True, True, True, False]), ([7, 3], [False, True]), ([2, 9, 9], [True, True, True])]
    ds = from_examples(examples)
    assert ds.label_token_counts(examples_per_chunk=2).tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 0, 2]
    view = ds.select(np.array([2, 2, 1]))
    assert view.label_token_counts().tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 4]
    mixture = MixtureDataset([ds, view], np.array([0, 1]), np.array([1, 0]), ds.stats, ["a", "b"])
    assert mixture.label_token_counts().tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 2]  # ds[1] and view[0] = ds[2]
    assert unigram_entropy(np.array([1, 1, 0, 2])) == pytest.approx(-2 * 0.25 * np.log(0.25) - 0.5 * np.log(0.5))
    assert np.isnan(unigram_entropy(np.zeros(3, np.int64)))


def test_truncation_alone_is_logged_as_information_skips_as_warnings(caplog):
    """``data.overlong=truncate`` truncating is what was asked for (the main job truncates 996 long dialogs):
    counted in an INFO line; a skipped record still warns."""
    from trainer.data.examples import DatasetStats, log_dataset_stats

    with caplog.at_level(logging.INFO):
        log_dataset_stats("x", DatasetStats(records=2, examples=2, truncated=1))
        log_dataset_stats("y", DatasetStats(records=2, examples=1, truncated=1, dropped_empty=1))
    levels = {r.getMessage().split(":")[0]: r.levelname for r in caplog.records if "truncated" in r.getMessage()}
    assert levels == {"data x": "INFO", "data y": "WARNING"}
