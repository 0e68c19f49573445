"""Chat rendering with assistant-only loss, text records, table sources, plugins and the tokenize-once cache."""

from __future__ import annotations

import csv
import json
from dataclasses import replace

import pytest

from tests.data_oracle import render_records
from trainer.config import ConfigError, DataConfig, ModelConfig
from trainer.data import load_dataset, load_records, load_tokenizer, register_source
from trainer.data.chat import CHATML_TEMPLATE, ChatTemplateError

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Where is the station?"},
    {"role": "assistant", "content": "Turn left at the park."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]

# A Llama-3-style template: BOS from the template text, header markers, end-of-turn after each message.
LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}<|end|>\n\n{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|end|>\n\n{% endif %}"
)
# Qwen2.5-style: a default system prompt when the conversation has none, indexing messages[0] (which an
# empty conversation cannot render).
QWEN_STYLE = (
    "{% if messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Moves the system prompt to the end: earlier renders are not prefixes of later ones.
NOT_PREFIX_STABLE = (
    "{% for m in messages if m['role'] != 'system' %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% for m in messages if m['role'] == 'system' %}[{{ m['content'] }}]{% endfor %}"
)


@pytest.fixture(scope="module")
def chat_cfg(cache_dir):
    return DataConfig(source="chat_synthetic", num_records=200, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def chatml_tokenizer(chat_cfg):
    return load_tokenizer(ModelConfig(chat_template="chatml", tokenizer_vocab_size=1024), chat_cfg)


def masked_text(tokenizer, ds, i=0):
    ids, mask = ds.example(i)
    return "".join(tokenizer.decode([t]) for t, m in zip(ids.tolist(), mask.tolist(), strict=True) if m)


def render(tokenizer, records, **cfg):
    return render_records(records, tokenizer, DataConfig(source="test", **cfg), max_length=10_000)


def test_chatml_loss_on_assistant_replies_only(chatml_tokenizer):
    ds = render(chatml_tokenizer, [{"messages": CHAT}])
    assert masked_text(chatml_tokenizer, ds) == "Turn left at the park.<|im_end|>\nYou are welcome.<|im_end|>\n"
    ids, _ = ds.example(0)
    # The whole example is the template's rendering, token for token at the special markers.
    assert chatml_tokenizer.decode(ids.tolist()) == chatml_tokenizer.apply_chat_template(
        CHAT, chat_template=CHATML_TEMPLATE, tokenize=False
    )
    everything = render(chatml_tokenizer, [{"messages": CHAT}], loss_on="all")
    assert everything.example(0)[1][1:].all()


def test_default_template_when_tokenizer_has_none(tokenizer):
    assert not getattr(tokenizer, "chat_template", None)
    ds = render(tokenizer, [{"messages": CHAT}], loss_on="responses")
    assert masked_text(tokenizer, ds) == "Turn left at the park.<|endoftext|>You are welcome.<|endoftext|>"
    text = tokenizer.decode(ds.example(0)[0].tolist())
    assert text.startswith("<|endoftext|>system:\nBe brief.<|endoftext|>user:\nWhere is the station?")


def test_other_template_and_refusal_of_unsplittable_one(tokenizer):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)  # a copy we may change
    tok.chat_template = LLAMA3_LIKE
    ds = render(tok, [{"messages": CHAT}])
    assert masked_text(tok, ds) == "Turn left at the park.<|eot|>You are welcome.<|eot|>"
    tok.chat_template = QWEN_STYLE
    ds = render(tok, [{"messages": CHAT[1:]}, {"messages": CHAT}])
    assert (
        masked_text(tok, ds, 0)
        == masked_text(tok, ds, 1)
        == "Turn left at the park.<|im_end|>\nYou are welcome.<|im_end|>\n"
    )
    assert tok.decode(ds.example(0)[0].tolist()).startswith("<|im_start|>system\nYou are a helpful assistant.")
    tok.chat_template = NOT_PREFIX_STABLE
    with pytest.raises(ChatTemplateError, match="model.chat_template"):
        render(tok, [{"messages": CHAT}])


def test_text_records_empty_and_malformed(tokenizer):
    ds = render(
        tokenizer, [{"text": "A plain document."}, {"text": "  "}, {"messages": [{"role": "user", "content": ""}]}]
    )
    assert len(ds) == 1 and ds.stats.dropped_empty == 2
    assert ds.example(0)[1][1:].all() and not ds.example(0)[1][0]
    prompt_only = render(tokenizer, [{"messages": [{"role": "user", "content": "hello?"}]}])
    assert prompt_only.stats.dropped_no_labels == 1  # counted, not silently lost
    with pytest.raises(ValueError, match="record 0"):
        render(tokenizer, [{"messages": [{"role": "user"}]}])
    with pytest.raises(ValueError, match="'messages', 'turns', 'text' or 'input_ids'"):
        render(tokenizer, [{"body": "x"}])


def test_table_sources_and_column_mapping(tmp_path):
    rows = [{"messages": CHAT}, {"messages": CHAT[1:3]}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    records = load_records(DataConfig(source="jsonl", path=str(tmp_path / "chat.jsonl")))
    assert records == [{"messages": CHAT}, {"messages": CHAT[1:3]}]

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["one doc", "two doc"]}), tmp_path / "docs.parquet")
    cfg = DataConfig(source="parquet", path=str(tmp_path / "docs.parquet"))
    with pytest.raises(ConfigError, match="data.columns"):
        load_records(cfg)
    assert load_records(replace(cfg, columns={"text": "body"})) == [{"text": "one doc"}, {"text": "two doc"}]

    with open(tmp_path / "qa.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["prompt", "response"])
        w.writeheader()
        w.writerow({"prompt": "Q?", "response": "A."})
    assert load_records(DataConfig(source="csv", path=str(tmp_path / "qa.csv"))) == [
        {"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]}
    ]

    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "train.jsonl").write_text(json.dumps(sharegpt) + "\n")
    # `hf` opens anything datasets.load_dataset opens: here a local folder, on a cluster a hub id.
    records = load_records(DataConfig(source="hf", path=str(tmp_path / "hub"), split="train"))
    assert records == [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]


CALLS = {"n": 0}


@register_source("counting_test_source")
def counting_test_source(cfg):
    CALLS["n"] += 1
    return [{"text": f"document number {i} about the weather."} for i in range(50)]


def test_tokenize_once_then_reuse_the_cache(tmp_path, tokenizer):
    cfg = DataConfig(source="counting_test_source", cache_dir=str(tmp_path), seed=CALLS["n"])
    first = load_dataset(cfg, tokenizer, max_length=128)
    assert CALLS["n"] == 1 and len(list((tmp_path / "datasets").glob("*/stats.json"))) == 1
    second = load_dataset(cfg, tokenizer, max_length=128)  # a second run: served from the cache
    assert CALLS["n"] == 1
    assert (first.tokens == second.tokens).all() and (first.loss_mask == second.loss_mask).all()
    load_dataset(replace(cfg, loss_on="all"), tokenizer, max_length=128)  # a different config re-tokenizes
    assert CALLS["n"] == 2


def test_plugins_register_sources(tmp_path, monkeypatch):
    (tmp_path / "my_plugin_mod.py").write_text(
        "from trainer.data import register_source\n"
        "@register_source('plugin_test_source')\n"
        "def src(cfg):\n    return [{'text': 'from a plugin'}]\n"
    )
    with pytest.raises(ConfigError, match="data.plugins"):
        load_records(DataConfig(source="plugin_test_source"))
    assert load_records(DataConfig(source="plugin_test_source", plugins=[str(tmp_path / "my_plugin_mod.py")])) == [
        {"text": "from a plugin"}
    ]
    monkeypatch.chdir(tmp_path)
    assert load_records(DataConfig(source="plugin_test_source", plugins=["my_plugin_mod"]))
    with pytest.raises(ConfigError, match="cannot import"):
        load_records(DataConfig(source="plugin_test_source", plugins=["no_such_module_xyz"]))


def test_a_plugin_registering_a_shipped_name_is_what_every_route_reads(tmp_path, tokenizer, monkeypatch):
    """The registry is honoured for every source: a plugin's own ``jsonl`` replaces the shipped one in the
    cached route, the stream and the tokenizer's sample alike (nothing reads the file through ``datasets``)."""
    from trainer.data import SOURCES
    from trainer.data.stream import ExampleStream
    from trainer.data.tokenizer import sample_records

    path = tmp_path / "lines.jsonl"
    path.write_text("first plain line\nsecond plain line\n")  # not JSON: only the plugin can read it
    monkeypatch.setitem(
        SOURCES, "jsonl", lambda cfg: [{"text": line} for line in open(cfg.path).read().split("\n") if line]
    )
    cfg = DataConfig(source="jsonl", path=str(path), cache_dir=str(tmp_path / "cache"))
    ds = load_dataset(cfg, tokenizer, max_length=64)
    assert ds.stats.records == 2 and len(ds) == 2
    assert [r["text"] for r in sample_records(cfg, 5)] == ["first plain line", "second plain line"]
    stream = ExampleStream(cfg, tokenizer, 64)
    assert len(stream.examples(stream.next_rows(8))[0]) == 2


def test_hub_dailydialog_reads_the_parquet_conversion_of_a_script_dataset(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, *args, split=None, revision=None, **kwargs):
        calls.append(revision)
        if revision is None:
            raise RuntimeError("Dataset scripts are no longer supported, but found daily_dialog.py")
        return datasets.Dataset.from_dict({"dialog": [["Hi there. ", " Hello!"]], "act": [[1, 2]]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    records = load_records(DataConfig(source="dailydialog", path="li2017dailydialog/daily_dialog"))
    assert records == [{"turns": ["Hi there.", "Hello!"]}]
    assert calls == [None, "refs/convert/parquet"]
