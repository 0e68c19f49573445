"""Issue 33 (cases 2 and 10): every cache packfsdp trusts proves itself. A config verdict is used only when its
entry verifies (its full key, an outcome packfsdp writes, its checksum); the local tokenizer only when its
files match what its build wrote; the data cache a run reads must not change under it. In-process."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import AutoConfig

from trainer.model import config_verdict
from trainer.model.config_verdict import verify_config
from trainer.model.families import FamilyRefusedError


def lfm2_with_conv_layers():
    return AutoConfig.for_model("lfm2", layer_types=["conv", "full_attention", "conv", "conv"], num_hidden_layers=4)


@pytest.fixture
def judged(tmp_path, monkeypatch) -> list[str]:
    """A cache of its own, and the judge replaced by one that counts its calls (the real replica of lfm2 is
    ``tests/unit/test_config_verdict.py``'s): lfm2 with conv layers is refused, anything else exact."""
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    calls = []

    def judge(config, family):
        calls.append(family)
        return ("refused", f"model family {family!r} cannot ... layer_types contains 'conv'") if family == "lfm2" else ("exact", "")

    monkeypatch.setattr(config_verdict, "_judge", judge)
    return calls


@pytest.mark.parametrize("forged", [
    '{"outcome": "exact", "line": ""}',  # the issue's forgery: lfm2's conv layers then trained mixing examples
    '{"outcome": "exa',  # truncated: a JSONDecodeError traceback on every later run
    "llama",  # a genuine entry of another config, copied over this one
    "edited",  # a genuine entry, its outcome edited (the checksum no longer matches)
])
def test_a_damaged_or_forged_verdict_is_judged_again(forged, judged, tmp_path, caplog):
    with pytest.raises(FamilyRefusedError, match="'lfm2'.*layer_types contains 'conv'"):
        verify_config(lfm2_with_conv_layers())
    [entry] = list((tmp_path / "verdicts").iterdir())
    if forged == "llama":
        assert verify_config(AutoConfig.for_model("llama", num_hidden_layers=2)) == "exact"
        forged = next(p for p in (tmp_path / "verdicts").iterdir() if p != entry).read_text()
    elif forged == "edited":
        forged = json.dumps(json.loads(entry.read_text()) | {"outcome": "exact", "line": ""})
    entry.write_text(forged)
    judged.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(FamilyRefusedError, match="layer_types contains 'conv'"):
        verify_config(lfm2_with_conv_layers())
    assert judged == ["lfm2"]
    assert [r for r in caplog.records if f"config verdict cache {entry} " in r.getMessage()], caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(FamilyRefusedError):  # rewritten: it verifies again
        verify_config(lfm2_with_conv_layers())
    assert judged == ["lfm2"] and not caplog.records


def test_a_verdict_is_keyed_by_the_code_that_judged_it(tmp_path, monkeypatch):
    """A change to the model package's source (how verdicts are judged) is a new key, not a stale verdict."""
    from trainer.model import verdict_cache

    config = AutoConfig.for_model("llama", num_hidden_layers=2)
    key = verdict_cache.verdict_key(config, 1)
    assert {"verdict_version", "code", "libraries", "config"} <= set(key)
    assert key["libraries"]["torch"] and key["libraries"]["transformers"]
    monkeypatch.setattr(verdict_cache, "_code_digest", lambda: "another")
    assert verdict_cache.verdict_key(config, 1) != key
