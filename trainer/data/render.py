"""Records -> rendered examples with their outcomes: the one renderer of every route.

A record is a dialog (``turns``), a chat (``messages``, rendered with the chat template, loss on the
assistant's replies by default) or a plain document (``text``); see ``record_segments``. The mask is
aligned with ``input_ids`` (the model shifts), so a token's mask says "this token is predicted". The first
token of an example never carries loss: nothing before it belongs to the same example.

Each record comes out with its ``Outcome`` (kept, truncated, empty, over-long, no labels, bad, over
``data.max_record_bytes``: left out before anything is rendered), and
``stats_of`` is the one place outcomes become ``DatasetStats``: bad input is never dropped silently.
``render_outcomes`` renders a chunk of records; ``render_batch`` is the same chunk function for a batch of
table rows, as ``datasets.map`` runs it (``trainer.data.cache``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
from transformers import PreTrainedTokenizerBase

from trainer.config import DataConfig
from trainer.data.bad_records import BadRecords, oversize_reason, record_bytes
from trainer.data.chat import (
    ChatTemplateError,
    Segment,
    chat_segments_batch,
    check_messages,
    effective_template,
    media_key,
    media_refusal,
)
from trainer.data.examples import DatasetStats
from trainer.data.pairs import PairToRender, is_pair_record, join_pair, only_last_replies, pair_segments
from trainer.data.parts import Places
from trainer.data.pretokenized import token_segments
from trainer.data.sources import Record
from trainer.data.tables import Row, rows_to_records

log = logging.getLogger(__name__)

RENDER_VERSION = 5
"""Bumped whenever rendering changes, so stale cached datasets are never reused (3: a chat is tokenized
whole, its mask taken from character spans, no longer piece by piece; 4, 5: preference pairs, a
``pair_split`` per example)."""


@dataclass
class ChatToRender:
    """A validated chat whose segments ``_record_segments`` renders together with the others of its batch."""

    messages: list[dict]


def record_segments(
    record: Record, tokenizer: PreTrainedTokenizerBase, loss_on: str, template: str, where: str
) -> list[Segment] | ChatToRender | PairToRender | None:
    """The pieces of one record (``None`` when it has no content; a chat is rendered later, in a batch).
    Four kinds of record, and preference pairs (``trainer.data.pairs``):

    - ``{"turns": [...]}`` (a dialog): ``BOS t1 EOS t2 EOS ...``; ``responses`` puts loss on turns 2, 4, ...
      and their EOS, ``all``/``auto`` on every turn;
    - ``{"messages": [...]}`` (a chat): rendered with the chat template (``trainer.data.chat``);
      ``auto``/``responses`` puts loss on the assistant messages only, ``all`` on everything;
    - ``{"text": "..."}`` (a plain document): ``BOS text EOS``, loss on every token;
    - ``{"input_ids": [...], "labels": [...]}`` (pre-tokenized, ``trainer.data.pretokenized``): the ids as
      they are, loss where the labels (or a ``loss_mask``) say.
    """
    if media := media_key(record):  # a source's own records (tables are checked row by row, rows_to_records)
        raise ValueError(f"{where}: {media_refusal(f'the record holds {media!r}')}")
    if is_pair_record(record):
        return pair_segments(record, tokenizer, where)
    if "input_ids" in record:
        return token_segments(record, len(tokenizer), loss_on, where)
    if "messages" in record:
        messages = check_messages(record["messages"], where)
        if not any(m["content"].strip() for m in messages):
            return None
        return ChatToRender(messages)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{where}: 'turns' must be a list of strings")
        if not any(t.strip() for t in turns):
            return None
        segments = [Segment([bos], False)]
        for k, turn in enumerate(turns):
            carries = loss_on != "responses" or k % 2 == 1
            segments += [Segment(turn, carries), Segment([eos], carries)]
        return segments
    if "text" in record:
        text = record["text"]
        if text is None or (isinstance(text, str) and not text.strip()):
            return None
        if not isinstance(text, str):
            raise ValueError(f"{where}: 'text' must be a string, got {type(text).__name__}")
        return [Segment([bos], False), Segment(text, True), Segment([eos], True)]
    raise ValueError(
        f"{where}: a record needs 'messages', 'turns', 'text' or 'input_ids' (keys: {', '.join(map(str, record))})"
    )


class Outcome(IntEnum):
    """What became of one record (the ``status`` column of the Arrow path, counted into ``DatasetStats``)."""

    KEPT = 0
    TRUNCATED = 1
    EMPTY = 2
    OVERLONG = 3
    NO_LABELS = 4
    BAD = 5
    OVERSIZE = 6


Rendered = tuple[list[int], list[bool], Outcome, int]
"""A record's tokens, loss mask, outcome (empty lists when it was left out) and pair split (a preference
pair: where its second sequence starts; 0 for every other record)."""


def render_outcomes(
    records: list[Record], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, max_length: int, bad: BadRecords
) -> list[Rendered]:
    """Every record rendered and tokenized, or the reason it was left out; bad records go to ``bad``.

    Every text piece of every record is tokenized in one batched call (fast tokenizers parallelise it).
    """
    per_record = _record_segments(records, tokenizer, cfg, bad)
    texts = [s.text for segs in per_record for s in _text_pieces(segs) if isinstance(s.text, str)]
    encoded = iter(encode_pieces(tokenizer, texts))
    out: list[Rendered] = []
    for segs in per_record:
        if isinstance(segs, list):
            out.append(_fit_example(segs, encoded, cfg.overlong, max_length))
        elif isinstance(segs, PairToRender):
            out.append(_fit_pair(segs, encoded, max_length))
        else:
            out.append(([], [], segs, 0))
    return out


def _text_pieces(segments) -> list[Segment]:
    """The segments of a record in tokenization order (a pair's chosen side, then its rejected side)."""
    if isinstance(segments, PairToRender):
        return segments.chosen + segments.rejected
    return segments if isinstance(segments, list) else []


def encode_pieces(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added. A fast tokenizer's backend is called directly: the
    ``tokenizer(...)`` wrapper builds a dict per text, which costs a third of the encoding itself."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]


def stats_of(outcomes: np.ndarray) -> DatasetStats:
    """The record counts of an array of ``Outcome`` codes (the kept-token counts are filled in later)."""
    n = np.bincount(np.asarray(outcomes, dtype=np.int64), minlength=len(Outcome))
    return DatasetStats(
        records=len(outcomes),
        examples=int(n[Outcome.KEPT] + n[Outcome.TRUNCATED]),
        truncated=int(n[Outcome.TRUNCATED]),
        dropped_empty=int(n[Outcome.EMPTY]),
        dropped_overlong=int(n[Outcome.OVERLONG]),
        dropped_no_labels=int(n[Outcome.NO_LABELS]),
        dropped_bad=int(n[Outcome.BAD]),
        dropped_oversize=int(n[Outcome.OVERSIZE]),
    )


def _record_segments(
    records: list[Record], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, bad: BadRecords
) -> list[list[Segment] | Outcome]:
    """Every record's segments, or ``EMPTY`` (no content), ``BAD`` (reported to ``bad``: an error naming
    the record under ``on_bad_record=error``, a counted skip under ``skip``) or ``OVERSIZE`` (over
    ``data.max_record_bytes``: skipped before it is rendered, reported to ``bad.oversize``)."""
    template = effective_template(tokenizer)
    per_record: list[list[Segment] | Outcome] = []
    for i, record in enumerate(records):
        where = getattr(record, "where", "") or f"data.source={cfg.source} record {i}"
        if not isinstance(record, dict):
            bad.bad(where, f"a {type(record).__name__}, not a dict")
            per_record.append(Outcome.BAD)
            continue
        if (size := record_bytes(record)) > cfg.max_record_bytes:
            bad.oversize(where, oversize_reason(size, cfg.max_record_bytes))
            per_record.append(Outcome.OVERSIZE)
            continue
        try:
            segments = record_segments(record, tokenizer, cfg.loss_on, template, where)
        except ValueError as e:
            if isinstance(e, ChatTemplateError):  # the template, not the record, is wrong: always an error
                raise
            bad.bad(where, str(e).removeprefix(f"{where}: "))
            segments = Outcome.BAD
        per_record.append(Outcome.EMPTY if segments is None else segments)
    chats = [p for p in per_record if isinstance(p, ChatToRender)]
    rendered = iter(chat_segments_batch([c.messages for c in chats], tokenizer, template, cfg.loss_on))
    pairs = [p for p in per_record if isinstance(p, PairToRender) and p.chat]
    # a pair's loss is on its reply, whatever data.loss_on says (its log-probs are what DPO compares)
    sides = iter(
        chat_segments_batch([m for p in pairs for m in (p.chosen, p.rejected)], tokenizer, template, "responses")
    )
    out = []
    for p in per_record:
        if isinstance(p, ChatToRender):
            p = next(rendered)
        elif isinstance(p, PairToRender) and p.chat:
            p = PairToRender(
                only_last_replies(next(sides), p.reply_turns[0]), only_last_replies(next(sides), p.reply_turns[1])
            )
        out.append(p)
    return out


def _fit_example(segments: list[Segment], encoded, overlong: str, max_length: int) -> Rendered:
    """One example's tokens and loss mask (text segments take their ids from ``encoded`` in order),
    truncated to ``max_length`` or dropped per ``overlong``."""
    ids, mask = _tokens(segments, encoded)
    outcome = Outcome.KEPT
    if len(ids) > max_length:
        if overlong == "drop":
            return [], [], Outcome.OVERLONG, 0
        outcome, ids, mask = Outcome.TRUNCATED, ids[:max_length], mask[:max_length]
    if not any(mask[1:]):
        return [], [], Outcome.NO_LABELS, 0
    return ids, mask, outcome, 0


def _tokens(segments: list[Segment], encoded) -> tuple[list[int], list[bool]]:
    ids: list[int] = []
    mask: list[bool] = []
    for s in segments:
        piece = next(encoded) if isinstance(s.text, str) else s.text
        ids += piece
        mask += [s.loss] * len(piece)
    return ids, mask


def _fit_pair(pair: PairToRender, encoded, max_length: int) -> Rendered:
    """A pair's stored example (``trainer.data.pairs.join_pair``); over ``max_length`` in all it is left out
    (never cut: a truncated reply is another reply), a side without a reply token likewise."""
    chosen, rejected = _tokens(pair.chosen, encoded), _tokens(pair.rejected, encoded)
    if len(chosen[0]) + len(rejected[0]) > max_length:
        return [], [], Outcome.OVERLONG, 0
    if not any(chosen[1][1:]) or not any(rejected[1][1:]):
        return [], [], Outcome.NO_LABELS, 0
    ids, mask, split = join_pair(chosen, rejected)
    return ids, mask, Outcome.KEPT, split


class RowProblems(BadRecords):
    """Bad rows inside a ``map`` worker, named ``#index``: under ``error`` raised with the row's place, under
    ``skip`` kept by index for the output's ``reason`` column (the main process counts and logs them)."""

    def __init__(self, mode: str, places: Places) -> None:
        super().__init__(mode)
        self.places = places
        self.reasons: dict[int, str] = {}

    def bad(self, where: str, reason: str, kind: str = "record") -> None:
        index = int(str.__str__(where).removeprefix("#"))
        if self.mode == "error":
            super().bad(self.places.where(index), reason, kind)
        self.reasons[index] = reason

    def oversize(self, where: str, reason: str) -> None:
        self.reasons[int(str.__str__(where).removeprefix("#"))] = reason


def render_batch(
    batch: dict[str, list],
    indices: list[int],
    *,
    tokenizer: PreTrainedTokenizerBase,
    cfg: DataConfig,
    max_length: int,
    places: Places,
) -> dict[str, list]:
    """The ``map`` function: a batch of rows -> one output row each (tokens, mask, outcome, reason)."""
    rows = []
    for k, index in enumerate(indices):
        row = Row({name: values[k] for name, values in batch.items()})
        row.where = f"#{index}"
        rows.append(row)
    problems = RowProblems(cfg.on_bad_record, places)
    records = rows_to_records(rows, cfg, problems)
    rendered = render_outcomes(records, tokenizer, cfg, max_length, problems)
    position = {index: k for k, index in enumerate(indices)}
    out = {
        "input_ids": [[] for _ in indices],
        "loss_mask": [[] for _ in indices],
        "status": [int(Outcome.BAD)] * len(indices),
        "reason": [""] * len(indices),
        "pair_split": [0] * len(indices),
    }
    for record, (ids, mask, outcome, split) in zip(records, rendered, strict=True):
        k = position[int(record.where[1:])]
        out["input_ids"][k], out["loss_mask"][k], out["status"][k], out["pair_split"][k] = (
            ids,
            mask,
            int(outcome),
            split,
        )
    for index, reason in problems.reasons.items():
        out["reason"][position[index]] = reason
    return out
