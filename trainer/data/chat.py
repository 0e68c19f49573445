"""Chat records rendered with a chat template, split into segments that do or do not carry loss.

A chat record is ``{"messages": [{"role": "system" | "user" | "assistant" | ..., "content": str}, ...]}``.
It is rendered with the tokenizer's own chat template (``tokenizer.chat_template``) when it has one, else
with ``model.chat_template`` (a Jinja string or one of the built-ins below).

Which tokens are the assistant's is found by rendering the conversation prefix by prefix, never by
searching the rendered text for role markers (which breaks on templates we have not seen)::

    P(k)      = render(messages[:k])                                  text up to the end of message k-1
    G(k)      = render(messages[:k], add_generation_prompt=True)       ... plus the assistant header
    message k = assistant: P(k) | G(k) - P(k) header (no loss) | P(k+1) - G(k) reply + end-of-turn (loss)

Each piece is tokenized on its own and the pieces are concatenated, so the prompt tokens are exactly what
the model sees at inference time (``add_generation_prompt=True``) and the reply tokens start where
generation starts. A template whose prefixes are not prefixes of the whole (one that rewrites earlier
turns, e.g. moves the system prompt) cannot be split this way and fails with a clear error.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

# The built-in fallback for tokenizers without a template: plain text role headers, each message closed
# by EOS (the tokenizer's end-of-sequence token, which every tokenizer packfsdp accepts has).
#   {bos}user:\n{content}{eos}assistant:\n{content}{eos}...
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}:\n{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:\n{% endif %}"
)

# ChatML (Qwen's format). Its markers are special tokens when the tokenizer has them (Qwen's do; the
# local BPE adds them when ``model.chat_template=chatml``).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]

BUILTIN_TEMPLATES = {"default": DEFAULT_CHAT_TEMPLATE, "chatml": CHATML_TEMPLATE}

ASSISTANT = "assistant"


class ChatTemplateError(ValueError):
    """A chat template cannot be split into prompt and reply pieces."""


@dataclass
class Segment:
    """A piece of an example: text to tokenize (or ready token ids) and whether its tokens carry loss."""

    text: str | list[int]
    loss: bool


def resolve_template(setting: str | None) -> str | None:
    """``model.chat_template``: ``None`` (the tokenizer's own), a built-in name, or a Jinja string."""
    if setting is None:
        return None
    return BUILTIN_TEMPLATES.get(setting, setting)


def apply_template_setting(tokenizer: PreTrainedTokenizerBase, setting: str | None) -> None:
    """Install ``model.chat_template`` on the tokenizer (it then travels with a saved tokenizer)."""
    template = resolve_template(setting)
    if template is not None:
        tokenizer.chat_template = template


def effective_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """The template chat records are rendered with: the tokenizer's own, else the documented default."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # tokenizers with several named templates: the default one
        template = template.get("default") or next(iter(template.values()))
    return template or DEFAULT_CHAT_TEMPLATE


def template_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Part of the dataset cache key: a changed template must re-render the data."""
    return hashlib.sha256(effective_template(tokenizer).encode()).hexdigest()[:16]


KNOWN_ROLES = ("system", "user", "assistant", "tool")
"""Roles a chat message may have (after ``data.roles`` renames); any other is a bad record: a typo such as
``asistant`` would otherwise silently lose its loss."""


def check_messages(messages: object, where: str) -> list[dict]:
    """Validate the shape of a ``messages`` value; a malformed record is an error naming the record."""
    if not isinstance(messages, list):
        raise ValueError(f"{where}: 'messages' must be a list of {{role, content}} dicts, got {type(messages).__name__}")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: every message needs a string 'role' and a string 'content', got {m!r}")
        if m["role"] not in KNOWN_ROLES:
            raise ValueError(
                f"{where}: unknown chat role {m['role']!r} (known: {', '.join(KNOWN_ROLES)}); "
                f"rename it with data.roles={{{m['role']}: user}} or similar"
            )
    return messages


def chat_segments(
    messages: list[dict], tokenizer: PreTrainedTokenizerBase, template: str, loss_on: str
) -> list[Segment]:
    """Split one rendered conversation into prompt pieces (no loss) and assistant pieces (loss).

    Args:
        messages: the conversation, already validated by ``check_messages``.
        tokenizer: supplies ``bos_token`` / ``eos_token`` and the other template variables.
        template: the Jinja chat template.
        loss_on: ``responses``/``auto`` (assistant messages only) or ``all`` (every token).
    """
    return chat_segments_batch([messages], tokenizer, template, loss_on)[0]


def chat_segments_batch(
    conversations: list[list[dict]], tokenizer: PreTrainedTokenizerBase, template: str, loss_on: str
) -> list[list[Segment]]:
    """``chat_segments`` of many conversations: all their prefixes rendered in one pass (see ``_renderer``)."""
    plain = [m[: k + 1] for m in conversations for k in range(len(m))]
    prompts = [m[:k] for m in conversations for k, message in enumerate(m) if message["role"] == ASSISTANT]
    render = _renderer(tokenizer, template, conversations)
    plain_texts = iter([render(p, False) for p in plain])
    prompt_texts = iter([render(p, True) if p else _render_empty(tokenizer, template, True) for p in prompts])
    return [_split(m, plain_texts, prompt_texts, loss_on) for m in conversations]


def _renderer(tokenizer: PreTrainedTokenizerBase, template: str, conversations: list[list[dict]]):
    """``render(messages, add_generation_prompt) -> str``: ``apply_chat_template``, or the compiled Jinja
    template called directly with what ``apply_chat_template`` passes it (the tokenizer's special tokens)
    when the messages hold only string roles and contents and both agree on the batch's first conversation.
    ``apply_chat_template`` copies and normalises every message on every call, which costs ~10x the render
    itself here, where each conversation is rendered once per prefix."""

    def slow(messages: list[dict], gen: bool) -> str:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=gen)

    plain = all(set(m) == {"role", "content"} for c in conversations for m in c)
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled, variables = _compile_jinja_template(template), dict(tokenizer.special_tokens_map)
    except (ImportError, AttributeError):  # a transformers without the (private) compiler
        return slow

    def fast(messages: list[dict], gen: bool) -> str:
        return compiled.render(messages=messages, tools=None, documents=None, add_generation_prompt=gen, **variables)

    first = next((c for c in conversations if c), None)
    agree = first is not None and all(fast(first, gen) == slow(first, gen) for gen in (False, True))
    return fast if plain and agree else slow


def _render_empty(tokenizer: PreTrainedTokenizerBase, template: str, gen: bool) -> str:
    if not gen:
        return ""
    try:
        return tokenizer.apply_chat_template([], chat_template=template, tokenize=False, add_generation_prompt=True)
    except Exception:  # templates that index messages[0] cannot render an empty conversation
        return ""


def _split(messages: list[dict], plain_texts, prompt_texts, loss_on: str) -> list[Segment]:
    """One conversation's segments from its rendered prefixes, taken in order from the two iterators."""
    segments: list[Segment] = []
    done = ""  # the text covered by segments so far
    for k, message in enumerate(messages):
        if message["role"] == ASSISTANT:
            prompt = next(prompt_texts)
            segments.append(Segment(_tail(prompt, done, k), loss_on == "all"))
            done = prompt
        full = next(plain_texts)
        segments.append(Segment(_tail(full, done, k), loss_on == "all" or message["role"] == ASSISTANT))
        done = full
    return [s for s in segments if s.text]


def _tail(text: str, prefix: str, k: int) -> str:
    if not text.startswith(prefix):
        raise ChatTemplateError(
            f"the chat template renders messages[:{k}] as text that is not a prefix of the longer conversation, so "
            "assistant tokens cannot be told apart from the prompt; set model.chat_template (e.g. 'chatml' or "
            "'default', or your own Jinja string) or data.loss_on=all"
        )
    return text[len(prefix):]
