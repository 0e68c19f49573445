"""Preference rows in the hub's shapes: UltraFeedback's (``HuggingFaceH4/ultrafeedback_binarized``: a string
``prompt`` and ``chosen`` / ``rejected`` holding the whole conversation, user turn included) and TRL's
implicit prompt (no ``prompt``: the replies' shared leading messages are it) render like the explicit form."""

from __future__ import annotations

import json

import pytest

from trainer.config import DataConfig
from trainer.data import load_dataset

USER = {"role": "user", "content": "Name a prime number above ten."}
GOOD = {"role": "assistant", "content": "Eleven is one."}
BAD = {"role": "assistant", "content": "Nine."}
EXPLICIT = {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}


@pytest.mark.parametrize(
    "row",
    [
        {
            "prompt": USER["content"],
            "chosen": [USER, GOOD],
            "rejected": [USER, BAD],
            "score_chosen": 8.0,
        },  # UltraFeedback
        {"chosen": [USER, GOOD], "rejected": [USER, BAD]},  # TRL's implicit prompt
    ],
    ids=["ultrafeedback", "implicit"],
)
def test_conversation_replies_render_like_an_explicit_prompt(tokenizer, tmp_path, row):
    stored = []
    for name, record in (("explicit", EXPLICIT), ("hub", row)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(record) + "\n")
        ds = load_dataset(DataConfig(source="jsonl", path=str(path), cache_dir=str(tmp_path / "cache")), tokenizer, 512)
        stored.append([(list(ids), list(mask)) for ids, mask in ds.pair(0)])
    assert stored[1] == stored[0]  # the user turn once per sequence, loss on the reply only
