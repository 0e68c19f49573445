"""Issue 33 (cases 2 and 10): every cache packfsdp trusts proves itself. A replica verdict is used only when its
entry verifies (its full key, an outcome packfsdp writes, its checksum); the local tokenizer only when its
files match what its build wrote; the data cache a run reads must not change under it. In-process."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from trainer.data.arrays import open_arrays
from trainer.data.bad_records import BadRecordError
from trainer.data.tokenizer import local_tokenizer
from trainer.model.certification import Stage, certify_config, replica
from trainer.model.certification import cache as verdict_cache
from trainer.model.families import FamilyRefusedError


def lfm2_with_conv_layers():
    return AutoConfig.for_model("lfm2", layer_types=["conv", "full_attention", "conv", "conv"], num_hidden_layers=4)


@pytest.fixture
def judged(tmp_path, monkeypatch) -> list[str]:
    """A cache of its own, and the judge replaced by one that counts its calls (the real replica of lfm2 is
    ``tests/unit/test_config_verdict.py``'s): lfm2 with conv layers is refused, anything else exact."""
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    calls = []

    def judge(config):
        calls.append(config.model_type)
        if config.model_type == "lfm2":
            return Stage("replica", "wrong", "with layer_types contains 'conv', examples of a packed row mix")
        return Stage("replica", "exact", "float64 |logit diff| 0, |grad diff| 0")

    monkeypatch.setattr(replica, "judge", judge)
    return calls


@pytest.mark.parametrize(
    "forged",
    [
        '{"outcome": "exact", "line": ""}',  # the issue's forgery: lfm2's conv layers then trained mixing examples
        '{"outcome": "exa',  # truncated: a JSONDecodeError traceback on every later run
        "llama",  # a genuine entry of another config, copied over this one
        "edited",  # a genuine entry, its outcome edited (the checksum no longer matches)
    ],
)
def test_a_damaged_or_forged_verdict_is_judged_again(forged, judged, tmp_path, caplog):
    with pytest.raises(FamilyRefusedError, match="'lfm2'.*layer_types contains 'conv'"):
        certify_config(lfm2_with_conv_layers())
    [entry] = list((tmp_path / "verdicts").iterdir())
    if forged == "llama":
        assert certify_config(AutoConfig.for_model("llama", num_hidden_layers=2)).stage("replica").outcome == "exact"
        forged = next(p for p in (tmp_path / "verdicts").iterdir() if p != entry).read_text()
    elif forged == "edited":
        forged = json.dumps(json.loads(entry.read_text()) | {"outcome": "exact", "line": ""})
    entry.write_text(forged)
    judged.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(FamilyRefusedError, match="layer_types contains 'conv'"):
        certify_config(lfm2_with_conv_layers())
    assert judged == ["lfm2"]
    assert [r for r in caplog.records if f"replica verdict cache {entry} " in r.getMessage()], caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(FamilyRefusedError):  # rewritten: it verifies again
        certify_config(lfm2_with_conv_layers())
    assert judged == ["lfm2"] and not caplog.records


def test_a_verdict_is_keyed_by_the_code_that_judged_it(tmp_path, monkeypatch):
    """A change to the model package's source (how verdicts are judged) is a new key, not a stale verdict."""
    config = AutoConfig.for_model("llama", num_hidden_layers=2)
    key = verdict_cache.verdict_key(config, 1)
    assert {"verdict_version", "code", "libraries", "config"} <= set(key)
    assert key["libraries"]["torch"] and key["libraries"]["transformers"]
    monkeypatch.setattr(verdict_cache, "_code_digest", lambda: "another")
    assert verdict_cache.verdict_key(config, 1) != key


# -------------------------------------------------------------------------------------- the data cache in use
def rewrite_in_place(path):
    """As the issue did: the same file, other ids (``np.save`` over it: same inode, same size)."""
    tokens = np.load(path)
    np.save(path, (tokens + 1) % max(int(tokens.max()), 2))


def replace_file(path):
    tokens = np.load(path)
    np.save(path.with_name("new.npy"), tokens[::-1].copy())
    os.replace(path.with_name("new.npy"), path)


def touch_back(path):
    """Rewritten, then its modification time set back: the change time still moves."""
    before = path.stat()
    rewrite_in_place(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("change", [rewrite_in_place, replace_file, touch_back])
def test_a_data_cache_changed_during_a_run_stops_it_before_a_step_trains_on_it(change, trainer, tmp_path):
    """Case 10: tokens.npy rewritten mid-run trained 9 more steps on the changed ids without a word. The loop
    checks the mapped files after reading each step's batches: one line (a data error), parameters untouched."""
    copy = Path(shutil.copytree(trainer.dataset.folder, tmp_path / "cache"))
    own = open_arrays(copy).select(trainer.dataset.rows)  # the run's examples, from a cache of this test's own
    saved = trainer.dataset
    trainer.dataset = own
    try:
        trainer.train_step()  # reads the cache as opened: fine
        change(copy / "tokens.npy")
        before = [p.detach().clone() for p in trainer.model.parameters()]
        # CacheChanged, a BadRecordError: "packfsdp: data error: ...", exit code 2
        with pytest.raises(
            BadRecordError, match=rf"{copy / 'tokens.npy'} was .* while this run read it .*nothing was trained"
        ):
            trainer.train_step()
        assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    finally:
        trainer.dataset = saved


# ------------------------------------------------------------------------------------- the local tokenizer
def edit_vocab(folder):
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: every text with them tokenizes otherwise
    (folder / "tokenizer.json").write_text(json.dumps(spec))


def add_template(folder):
    (folder / "chat_template.jinja").write_text("{{ 'every chat rendered as this' }}")  # a loader reads it


def unsealed(folder):
    (folder / "checksums.json").unlink()  # as packfsdp cached tokenizers before they were sealed


@pytest.mark.parametrize("change", [edit_vocab, add_template, unsealed])
def test_a_changed_local_tokenizer_is_trained_again(change, tmp_path, caplog):
    def texts():
        return iter(["hello there, general kenobi", "you are a bold one"] * 50)

    first = local_tokenizer(texts, 300, tmp_path, "key")
    [folder] = list((tmp_path / "tokenizers").iterdir())
    change(folder)
    with caplog.at_level(logging.WARNING):
        again = local_tokenizer(texts, 300, tmp_path, "key")
    assert f"the tokenizer cache {folder} does not verify" in caplog.text
    assert again.get_vocab() == first.get_vocab() and again.chat_template == first.chat_template
