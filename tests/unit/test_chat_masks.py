"""Chat loss masks from one tokenization of the whole conversation: the mask covers exactly the assistant
replies (with their end-of-turn), for several templates, whether the spans come from the role sequence's
skeleton or from the conversation's own prefixes."""

from __future__ import annotations

import pytest

import trainer.data.chat as chat
from tests.unit.test_chat_sources import LLAMA3_LIKE, QWEN_STYLE
from trainer.data.chat import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, DEFAULT_CHAT_TEMPLATE, chat_segments_batch
from trainer.data.tokenizer import train_bpe_tokenizer

# Rewrites contents (trims them): the skeleton's check fails and each conversation is split by its prefixes.
TRIMMING = (
    "{% for m in messages %}### {{ m['role'] }}\n{{ m['content'] | trim }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant\n{% endif %}"
)
TEMPLATES = {
    "chatml": CHATML_TEMPLATE,
    "default": DEFAULT_CHAT_TEMPLATE,
    "llama3_like": LLAMA3_LIKE,
    "qwen_style": QWEN_STYLE,
    "trimming": TRIMMING,
}

CONVERSATIONS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is the station?"},
        {"role": "assistant", "content": "Turn left at the park."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."},
    ],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, friend."}],
    [{"role": "user", "content": "  spaced  "}, {"role": "assistant", "content": " padded reply "}],
    [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "ok"}],
    [{"role": "user", "content": "Empty answer?"}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="module")
def bpe():
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["assistant user system ### station park"] * 20
    return train_bpe_tokenizer(texts, 400, CHATML_SPECIAL_TOKENS)


def expected_replies(tokenizer, template: str, messages: list[dict]) -> str:
    """The assistant replies with their end-of-turn, cut from prefix renders: ``P(k+1) - G(k)``."""

    def render(m, gen):
        return tokenizer.apply_chat_template(m, chat_template=template, tokenize=False, add_generation_prompt=gen)

    return "".join(
        render(messages[: k + 1], False)[len(render(messages[:k], True)) :]
        for k, m in enumerate(messages)
        if m["role"] == "assistant" and k
    )


def masked_and_whole(tokenizer, segments) -> tuple[str, list[int]]:
    ids = [t for s in segments for t in s.text]
    return "".join(tokenizer.decode(s.text) for s in segments if s.loss), ids


@pytest.mark.parametrize("name", TEMPLATES)
def test_mask_covers_exactly_the_assistant_replies(bpe, name):
    template = TEMPLATES[name]
    segments = chat_segments_batch(CONVERSATIONS, bpe, template, "responses")
    for messages, segs in zip(CONVERSATIONS, segments, strict=True):
        masked, ids = masked_and_whole(bpe, segs)
        whole = bpe.apply_chat_template(messages, chat_template=template, tokenize=False)
        assert ids == bpe(whole, add_special_tokens=False)["input_ids"]  # one tokenization of the whole text
        if messages[0]["role"] != "assistant":
            assert masked == expected_replies(bpe, template, messages)
        assert all(isinstance(s.text, list) for s in segs)


@pytest.mark.parametrize("name", TEMPLATES)
def test_skeleton_and_prefix_splits_agree(bpe, name, monkeypatch):
    fast = chat_segments_batch(CONVERSATIONS, bpe, TEMPLATES[name], "responses")
    split_by_prefixes, original = [], chat._prefix_spans
    monkeypatch.setattr(chat, "_prefix_spans", lambda *a: split_by_prefixes.append(1) or original(*a))
    monkeypatch.setattr(chat._Skeleton, "of", classmethod(lambda cls, *a: None))
    assert chat_segments_batch(CONVERSATIONS, bpe, TEMPLATES[name], "responses") == fast
    assert split_by_prefixes  # the second run took the prefix path


def test_trimming_template_falls_back_per_conversation(bpe, monkeypatch):
    calls = []
    original = chat._prefix_spans
    monkeypatch.setattr(chat, "_prefix_spans", lambda messages, *a: calls.append(messages) or original(messages, *a))
    chat_segments_batch(CONVERSATIONS, bpe, TRIMMING, "responses")
    contents = [[m["content"] for m in c] for c in calls]
    assert [" padded reply "] in [c[1:] for c in contents]  # the conversation whose contents it rewrote
    assert [m["content"] for m in CONVERSATIONS[1]] not in contents  # the others took the skeleton


def test_loss_on_all_needs_no_prefix_stable_template(bpe):
    moves_system = (
        "{% for m in messages if m['role'] != 'system' %}{{ m['content'] }}\n{% endfor %}"
        "{% for m in messages if m['role'] == 'system' %}[{{ m['content'] }}]{% endfor %}"
    )
    (segments,) = chat_segments_batch(CONVERSATIONS[:1], bpe, moves_system, "all")
    assert len(segments) == 1 and segments[0].loss


def test_a_slow_tokenizer_gets_text_pieces(bpe, monkeypatch):
    monkeypatch.setattr(type(bpe), "is_fast", property(lambda self: False))
    (segments,) = chat_segments_batch(CONVERSATIONS[1:2], bpe, CHATML_TEMPLATE, "responses")
    assert [s.text for s in segments if s.loss] == ["Hello there, friend.<|im_end|>\n"]
