"""Preference pairs through the one data route (``trainer.data.pairs``): rows -> one stored example per pair,
labels on the replies only, bad pairs named by file:line or skipped and counted, the same cache as SFT."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import compose_job
from trainer.collate import collate_packed
from trainer.config import ConfigError, DataConfig
from trainer.data import load_dataset
from trainer.data.bad_records import BadRecordError
from trainer.data.examples import IGNORE_INDEX


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(tokenizer, path, cache, source="jsonl", max_length=512, **kw):
    return load_dataset(DataConfig(source=source, path=str(path), cache_dir=str(cache), **kw), tokenizer, max_length)


def decode_labels(tokenizer, ids, mask):
    return tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])


def test_string_pairs_keep_loss_on_the_replies(tokenizer, tmp_path):
    rows = [
        {"prompt": "How are you today?", "chosen": " Fine, thanks.", "rejected": " Go away."},
        {"prompt": "Where is the station?", "chosen": " Two blocks left.", "rejected": " No idea at all, sorry."},
    ]
    ds = load(tokenizer, write_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "cache")
    assert ds.is_pairs and len(ds) == 2 and ds.stats.examples == 2
    (c_ids, c_mask), (r_ids, r_mask) = ds.pair(1)
    eos = tokenizer.eos_token
    assert decode_labels(tokenizer, c_ids, c_mask) == " Two blocks left." + eos
    assert decode_labels(tokenizer, r_ids, r_mask) == " No idea at all, sorry." + eos
    prompt = len(c_ids) - int(c_mask.sum())
    assert list(c_ids[:prompt]) == list(r_ids[:prompt])  # the prompt, stored once per sequence
    assert not r_mask[0] and ds.label_counts()[1] == c_mask.sum() + r_mask.sum()
    batch = collate_packed(ds, np.array([0, 1]))
    assert batch.num_pairs == 2 and batch.num_examples == 4 and batch.num_label_tokens == int(ds.label_counts().sum())
    cu = batch.cu_seqlens.tolist()
    assert all(batch.position_ids[0, a] == 0 and batch.labels[0, a] == IGNORE_INDEX for a in cu[:-1])


def test_chat_pairs_put_loss_on_the_final_reply_only(tokenizer, tmp_path):
    prompt = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Book a table"},
    ]
    rows = [
        {
            "prompt": prompt,
            "chosen": [{"role": "assistant", "content": "Done, for two at eight."}],
            "rejected": [{"role": "assistant", "content": "No."}],
        }
    ]
    ds = load(tokenizer, write_jsonl(tmp_path / "c.jsonl", rows), tmp_path / "cache")
    (c_ids, c_mask), (r_ids, r_mask) = ds.pair(0)
    assert "Done, for two at eight." in decode_labels(tokenizer, c_ids, c_mask)
    assert "help" not in decode_labels(tokenizer, c_ids, c_mask)  # the prompt's assistant turn carries none
    assert decode_labels(tokenizer, r_ids, r_mask).startswith("No.")


def test_pretokenized_pairs(tokenizer):
    """TRL's tokenized columns: the ids as they are, loss on the reply ids (rendered by the one renderer)."""
    from trainer.data.bad_records import BadRecords
    from trainer.data.render import render_outcomes

    rows = [{"prompt_input_ids": [5, 6, 7], "chosen_input_ids": [8, 9], "rejected_input_ids": [10, 11, 12]}]
    ((ids, mask, _, split),) = render_outcomes(rows, tokenizer, DataConfig(), 64, BadRecords())
    assert ids == [5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12] and split == 5
    assert mask == [False] * 3 + [True] * 2 + [False] * 3 + [True] * 3


BAD_ROWS = [
    {"prompt": "a question", "chosen": "a fine answer"},  # no rejected
    {"prompt": "a question", "chosen": "   ", "rejected": "an answer"},  # empty reply
    {"prompt": "a question", "chosen": "the same", "rejected": "the same"},  # identical
]


@pytest.mark.parametrize("k", range(len(BAD_ROWS)))
def test_a_bad_pair_is_named_by_file_and_line(tokenizer, tmp_path, k):
    good = {"prompt": "q", "chosen": "yes please", "rejected": "no thanks"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, BAD_ROWS[k], good])
    with pytest.raises(BadRecordError, match=r"bad\.jsonl:2: .*(rejected|empty|identical)"):
        load(tokenizer, path, tmp_path / "cache")


def test_bad_and_overlong_pairs_are_skipped_and_counted(tokenizer, tmp_path):
    good = {"prompt": "q", "chosen": "yes please", "rejected": "no thanks"}
    long = {"prompt": "q", "chosen": "word " * 200, "rejected": "other " * 200}
    path = write_jsonl(tmp_path / "mixed.jsonl", [good, *BAD_ROWS, long, good])
    ds = load(tokenizer, path, tmp_path / "cache", max_length=128, on_bad_record="skip")
    assert len(ds) == 2 and ds.stats.dropped_bad == 3 and ds.stats.dropped_overlong == 1 and ds.stats.records == 6


def test_the_generated_pairs_spread_in_length_and_train_only_with_dpo(tokenizer, cache_dir):
    ds = load_dataset(DataConfig(source="preference_synthetic", num_records=300, cache_dir=cache_dir), tokenizer, 2048)
    assert ds.is_pairs and len(ds) == 300
    lengths = ds.lengths
    assert lengths.std() / lengths.mean() > 0.4 and lengths.max() > 3 * np.median(lengths)  # long-tailed
    from trainer.pipeline import check_objective_fits_data

    with pytest.raises(ConfigError, match="objective=dpo"):
        check_objective_fits_data(compose_job(["data=preference_synthetic"]), pairs=True)
    with pytest.raises(ConfigError, match="needs preference pairs"):
        check_objective_fits_data(compose_job(["objective=dpo"]), pairs=False)


def test_dpo_config_composes_and_refuses_what_it_cannot_pack():
    cfg = compose_job(["recipe=cpu_dpo"])
    assert cfg.objective == "dpo" and cfg.dpo.beta == 0.1 and cfg.dpo.reference == "live"
    for overrides, match in (
        (["packing=bfd_split"], "packing.strategy"),
        (["dpo.loss=kto"], "dpo.loss"),
        (["dpo.label_smoothing=0.6"], "label_smoothing"),
        (["parallel.cp=2"], "parallel.cp"),
        (["dpo.loss=ipo", "dpo.label_smoothing=0.1"], "applies to dpo.loss=sigmoid"),
    ):
        with pytest.raises(ConfigError, match=match):
            compose_job(["recipe=cpu_dpo", *overrides])
