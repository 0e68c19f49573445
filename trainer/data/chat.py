"""Chat records rendered with a chat template, split into segments that do or do not carry loss.

A chat record is ``{"messages": [{"role": "system" | "user" | "assistant" | ..., "content": str}, ...]}``.
It is rendered with the tokenizer's own chat template (``tokenizer.chat_template``) when it has one, else
with ``model.chat_template`` (a Jinja string or one of the built-ins below).

Which characters are the assistant's is found by rendering the conversation prefix by prefix, never by
searching the rendered text for role markers (which breaks on templates we have not seen)::

    P(k)      = render(messages[:k])                                  text up to the end of message k-1
    G(k)      = render(messages[:k], add_generation_prompt=True)       ... plus the assistant header
    message k = assistant: P(k) | G(k) - P(k) header (no loss) | P(k+1) - G(k) reply + end-of-turn (loss)

The prefixes are rendered once per role sequence, with placeholder contents (``_Skeleton``); a conversation
is then rendered once, and where its text is the skeleton's with its contents in place, its reply spans
are the skeleton's, moved by the contents' lengths (else its own prefixes are rendered). The whole text is
tokenized in one call and a token carries loss when one of its characters lies in a reply span (the
offsets of the fast tokenizer; the rule of ``apply_chat_template(return_assistant_tokens_mask=True)``),
so the tokens are exactly those of the rendered conversation. A template whose prefixes are not prefixes of
the whole (one that rewrites earlier turns, e.g. moves the system prompt) cannot be split this way and
fails with a clear error (``data.loss_on=all`` needs no split and takes it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from jinja2.exceptions import SecurityError, TemplateSyntaxError
from transformers import PreTrainedTokenizerBase

from trainer.errors import ConfigError

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


class ChatTemplateError(ConfigError):
    """A chat template cannot be used: it is not valid Jinja, the sandbox blocked it, or it cannot be split into
    prompt and reply pieces (a setting to change, so one line and exit code 2)."""


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


MEDIA = ("image", "image_url", "input_image", "video", "video_url", "audio", "audio_url", "input_audio")
"""Kinds of message content part that carry no text (OpenAI's and transformers' chat formats:
``{"type": "image", ...}``, ``{"type": "image_url", "image_url": {...}}``): packfsdp packs text only."""


def media_refusal(what: str) -> str:
    """Why a record with an image (video, audio) is refused, and what to do instead."""
    return (
        f"{what}: packfsdp packs text-only examples; train the text-only examples, or image+text examples "
        "with a multimodal trainer"
    )


MEDIA_KEYS = ("images", "image", "videos", "video", "audios", "audio")
"""Record (or table row) keys that hold images, videos or audio beside the text (``{"messages": [...],
"images": [...]}``): such a record is refused (``media_refusal``), never trained on its text alone."""


def media_key(record: dict) -> str | None:
    """The first of ``MEDIA_KEYS`` that ``record`` holds a value under, or ``None``."""

    def held(value) -> bool:
        return value is not None and not (isinstance(value, (str, list, tuple, dict)) and len(value) == 0)

    return next((k for k in MEDIA_KEYS if held(record.get(k))), None)


def media_part(content: object) -> str | None:
    """The kind of the first part of a message's ``content`` (a list of parts) that is no text, or ``None``."""
    for part in content if isinstance(content, list) else ():
        if isinstance(part, dict):
            kind = part.get("type")
            if kind in MEDIA or (kind := next((k for k in MEDIA if part.get(k) is not None), None)):
                return kind
    return None


def check_messages(messages: object, where: str) -> list[dict]:
    """Validate the shape of a ``messages`` value; a malformed record is an error naming the record, one
    with an image (video, audio) part too (``media_refusal``)."""
    if not isinstance(messages, list):
        raise ValueError(
            f"{where}: 'messages' must be a list of {{role, content}} dicts, got {type(messages).__name__}"
        )
    for k, m in enumerate(messages):
        if isinstance(m, dict) and (kind := media_part(m.get("content"))):
            raise ValueError(f"{where}: {media_refusal(f'message {k} holds an {kind!r} part')}")
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
    """``chat_segments`` of many conversations: each rendered once, all tokenized in one batched call. With a
    fast tokenizer the segments hold token ids; with a slow one (no offsets) text pieces, tokenized apart."""
    try:
        texts_and_spans = loss_spans_batch(conversations, tokenizer, template, loss_on)
    except SecurityError as e:  # transformers renders templates in an ImmutableSandboxedEnvironment
        raise ChatTemplateError(
            f"the chat template was blocked by the Jinja sandbox transformers renders it in ({e}); nothing unsafe "
            "ran. Fix the template (model.chat_template, or the tokenizer's own) or set model.chat_template=chatml"
        ) from None
    except TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the chat template is not valid Jinja (line {e.lineno}: {e.message}); fix it, "
            "or set model.chat_template=chatml"
        ) from None
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return [_text_segments(text, spans) for text, spans in texts_and_spans]
    encodings = backend.encode_batch([text for text, _ in texts_and_spans], add_special_tokens=False)
    return [_token_segments(e, spans) for e, (_, spans) in zip(encodings, texts_and_spans, strict=True)]


Span = tuple[int, int]
"""Characters ``[start, end)`` of a rendered conversation that carry loss."""


def loss_spans_batch(
    conversations: list[list[dict]], tokenizer: PreTrainedTokenizerBase, template: str, loss_on: str
) -> list[tuple[str, list[Span]]]:
    """Each conversation's rendered text and its loss spans: everything under ``loss_on=all``, else each
    assistant reply ``P(k+1) - G(k)``. Conversations of one role sequence share a skeleton (``_Skeleton``),
    so each is rendered once; one the skeleton does not predict is split by its own prefixes."""
    render = _renderer(tokenizer, template, conversations)
    if loss_on == "all":
        return [(text, [(0, len(text))]) for text in (render(m, False) for m in conversations)]
    empty_prompt = _LazyEmptyPrompt(tokenizer, template)
    skeletons: dict[tuple[str, ...], _Skeleton | None] = {}
    out = []
    for messages in conversations:
        roles = tuple(m["role"] for m in messages)
        if roles not in skeletons:
            skeletons[roles] = _Skeleton.of(roles, render, empty_prompt)
        skeleton = skeletons[roles]
        found = skeleton.apply(messages, render) if skeleton is not None else None
        out.append(found or _prefix_spans(messages, render, empty_prompt))
    return out


SENTINEL = "\ue000{}\ue001"
"""The content of message k in a skeleton: private-use characters no template writes itself."""


@dataclass
class _Skeleton:
    """A role sequence rendered with sentinel contents: the text around the contents (``literals``) and each
    loss span's ends as (literal index, offset into it). A conversation of these roles whose own rendering
    is the literals with its contents in between (checked, one render) has its spans at the same places;
    a template that rewrites contents (trims, escapes, drops one) fails the check and is split by prefixes."""

    literals: list[str]
    ends: list[tuple[tuple[int, int], tuple[int, int]]]

    @classmethod
    def of(cls, roles: tuple[str, ...], render, empty_prompt) -> _Skeleton | None:
        messages = [{"role": role, "content": SENTINEL.format(k)} for k, role in enumerate(roles)]
        text, spans = _prefix_spans(messages, render, empty_prompt)
        literals, bounds, pos = [], [], 0
        for k in range(len(roles)):
            sentinel = SENTINEL.format(k)
            at = text.find(sentinel, pos)
            if at < 0 or text.count(sentinel) != 1:
                return None  # the template drops or repeats a content
            literals.append(text[pos:at])
            bounds.append((at, at + len(sentinel)))
            pos = at + len(sentinel)
        literals.append(text[pos:])

        def locate(char: int) -> tuple[int, int] | None:
            j = sum(end <= char for _, end in bounds)  # the contents wholly before ``char``
            if j < len(bounds) and bounds[j][0] < char:
                return None  # inside a content
            return j, char - (bounds[j - 1][1] if j else 0)

        ends = [(locate(a), locate(b)) for a, b in spans]
        return None if any(x is None for pair in ends for x in pair) else cls(literals, ends)

    def apply(self, messages: list[dict], render) -> tuple[str, list[Span]] | None:
        """``messages``' text and spans, or ``None`` when its rendering is not the skeleton's."""
        starts, pieces, pos = [], [], 0
        for literal, message in zip(self.literals, messages, strict=False):  # one literal more: the tail
            starts.append(pos)
            pieces += [literal, message["content"]]
            pos += len(literal) + len(message["content"])
        starts.append(pos)
        pieces.append(self.literals[-1])
        text = render(messages, False)
        if text != "".join(pieces):
            return None
        return text, [(starts[a[0]] + a[1], starts[b[0]] + b[1]) for a, b in self.ends]


class _LazyEmptyPrompt:
    """The generation prompt of an empty conversation, rendered once and only when needed."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str) -> None:
        self.tokenizer, self.template, self.text = tokenizer, template, None

    def __call__(self) -> str:
        if self.text is None:
            self.text = _render_empty(self.tokenizer, self.template, True)
        return self.text


def _prefix_spans(messages: list[dict], render, empty_prompt) -> tuple[str, list[Span]]:
    """The whole text and each assistant reply's span ``[G(k), P(k+1))``, from the prefix renders."""
    spans: list[Span] = []
    done = ""  # the text accounted for so far
    for k, message in enumerate(messages):
        if message["role"] == ASSISTANT:
            prompt = render(messages[:k], True) if k else empty_prompt()
            _check_prefix(prompt, done, k)
            done = prompt
        full = render(messages[: k + 1], False)
        _check_prefix(full, done, k)
        if message["role"] == ASSISTANT and len(full) > len(done):
            spans.append((len(done), len(full)))
        done = full
    return done, spans


def _token_segments(encoding, spans: list[Span]) -> list[Segment]:
    """Token-id segments of one encoded text: a token carries loss when any of its characters lies in a
    span (the rule of ``return_assistant_tokens_mask``: a token across a span's edge is the reply's)."""
    ids, segments, done = encoding.ids, [], 0
    for a, b in spans:
        first, last = _token_at(encoding, range(a, b)), _token_at(encoding, range(b - 1, a - 1, -1))
        if first is None or last is None:
            continue
        first = max(first, done)
        segments += [Segment(ids[done:first], False), Segment(ids[first : last + 1], True)]
        done = max(done, last + 1)
    segments.append(Segment(ids[done:], False))
    return [s for s in segments if s.text]


def _token_at(encoding, chars: range) -> int | None:
    """The token of the first of ``chars`` that has one (a character may belong to none, e.g. one the
    normalizer removed)."""
    for c in chars:
        token = encoding.char_to_token(c)
        if token is not None:
            return token
    return None


def _text_segments(text: str, spans: list[Span]) -> list[Segment]:
    """Text pieces split at the span edges (a tokenizer without offsets tokenizes each piece apart)."""
    segments, done = [], 0
    for a, b in spans:
        segments += [Segment(text[done:a], False), Segment(text[a:b], True)]
        done = b
    segments.append(Segment(text[done:], False))
    return [s for s in segments if s.text]


def _renderer(tokenizer: PreTrainedTokenizerBase, template: str, conversations: list[list[dict]]):
    """``render(messages, add_generation_prompt) -> str``: ``apply_chat_template``, or the compiled Jinja
    template called directly with what ``apply_chat_template`` passes it (the tokenizer's special tokens)
    when the messages hold only string roles and contents and both agree on the batch's first conversation.
    ``apply_chat_template`` copies and normalises every message on every call, which costs ~10x the render
    itself here, where each conversation is rendered once per prefix."""

    def slow(messages: list[dict], gen: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=gen
        )

    plain = all(set(m) == {"role", "content"} for c in conversations for m in c)
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template  # noqa: PLC0415 -- private: a transformers without it renders slowly (below)

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
    except Exception:  # noqa: BLE001 -- templates that index messages[0] cannot render an empty conversation
        return ""


def _check_prefix(text: str, prefix: str, k: int) -> None:
    if not text.startswith(prefix):
        raise ChatTemplateError(
            f"the chat template renders messages[:{k}] as text that is not a prefix of the longer conversation, so "
            "assistant tokens cannot be told apart from the prompt; set model.chat_template (e.g. 'chatml' or "
            "'default', or your own Jinja string) or data.loss_on=all"
        )
