"""Preference pairs: one more row shape through the one data route (``render.record_segments``).

A pair record holds a prompt and two replies, TRL's preference format::

    {"prompt": str | [messages], "chosen": str | [messages], "rejected": str | [messages]}
    {"prompt_input_ids": [...], "chosen_input_ids": [...], "rejected_input_ids": [...]}   (pre-tokenized)

It renders to two sequences, ``prompt + chosen`` and ``prompt + rejected``, with loss (the DPO log-probs) on
the reply tokens only, and is stored as ONE example of ``TokenizedDataset`` (the two sequences back to
back, ``pair_splits`` saying where the second starts). Packing, the rank deal, the held-out split and the
cache therefore keep a pair together without knowing about pairs; ``trainer.collate`` cuts the example
into its two sequences, each its own varlen segment with positions from 0.

The prompt is stored twice, once per sequence: sharing it would need a tree mask (the rejected reply
attending to the chosen one's prompt but not to the chosen reply), which the varlen kernels cannot
express; ``docs/dpo.md`` measures what the copy costs.

Plain strings: ``[BOS] prompt reply [EOS]`` per sequence (BOS: the tokenizer's, else its EOS), loss on the
reply and its EOS, prompt and reply tokenized apart (as TRL does). Chats: ``prompt + reply`` messages
rendered with the chat template, loss on the reply's assistant message(s) only (earlier assistant turns of
the prompt carry none). Bad pairs (a missing field, an empty reply, identical replies) are reported to
``BadRecords`` like any bad row (an error naming the place, or a counted skip); a pair longer than the
example budget is left out and counted (``dropped_overlong``): cutting it would change what is compared.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.data.chat import Segment, check_messages
from trainer.data.pretokenized import token_segments

PAIR_FIELDS = ("prompt", "chosen", "rejected")
TOKEN_PAIR_FIELDS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")


def is_pair_record(record: dict) -> bool:
    return "chosen" in record or "chosen_input_ids" in record


@dataclass
class PairToRender:
    """A validated pair: each side is ready segments, or (a chat) its messages, rendered in a batch later;
    ``reply_turns``: how many assistant messages of a chat side are the reply (they alone carry loss)."""

    chosen: list[Segment] | list[dict]
    rejected: list[Segment] | list[dict]
    chat: bool = False
    reply_turns: tuple[int, int] = (0, 0)


def pair_segments(record: dict, tokenizer, where: str) -> PairToRender:
    """The two sides of a pair record (``ValueError`` naming ``where`` for a bad one)."""
    if "chosen_input_ids" in record:
        return _token_pair(record, len(tokenizer), where)
    record = with_explicit_prompt(record)
    missing = [f for f in PAIR_FIELDS if record.get(f) is None]
    if missing:
        raise ValueError(f"{where}: a preference pair needs {', '.join(PAIR_FIELDS)}; missing {', '.join(missing)}")
    prompt, chosen, rejected = (record[f] for f in PAIR_FIELDS)
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        _check_replies(chosen.strip(), rejected.strip(), chosen == rejected, where)
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id

        def side(reply):
            return [
                Segment([bos], False),
                Segment(prompt, False),
                Segment(reply, True),
                Segment([tokenizer.eos_token_id], True),
            ]

        return PairToRender(side(chosen), side(rejected))
    if isinstance(prompt, str):  # a plain prompt with chat replies: the user's turn
        prompt = [{"role": "user", "content": prompt}]
    prompt = check_messages(prompt, where)
    replies = [
        check_messages([{"role": "assistant", "content": r}] if isinstance(r, str) else r, where)
        for r in (chosen, rejected)
    ]
    text = ["".join(m["content"] for m in r if m["role"] == "assistant") for r in replies]
    _check_replies(text[0].strip(), text[1].strip(), replies[0] == replies[1], where)
    turns = tuple(sum(m["role"] == "assistant" for m in r) for r in replies)
    return PairToRender(prompt + replies[0], prompt + replies[1], chat=True, reply_turns=turns)


def with_explicit_prompt(record: dict) -> dict:
    """TRL's implicit prompt: chat replies that carry the conversation (UltraFeedback's ``chosen`` /
    ``rejected`` hold the user turn and the reply) get their shared leading messages as the prompt (no
    ``prompt`` field), or lose the copy of the prompt they start with (a ``prompt`` field too)."""
    chosen, rejected, prompt = record.get("chosen"), record.get("rejected"), record.get("prompt")
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        return record
    if prompt is None:
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        return record | {"prompt": chosen[:shared] or None, "chosen": chosen[shared:], "rejected": rejected[shared:]}
    lead = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if lead and chosen[: len(lead)] == lead and rejected[: len(lead)] == lead:
        return record | {"chosen": chosen[len(lead) :], "rejected": rejected[len(lead) :]}
    return record


def _check_replies(chosen: str, rejected: str, identical: bool, where: str) -> None:
    empty = [name for name, text in (("chosen", chosen), ("rejected", rejected)) if not text]
    if empty:
        raise ValueError(f"{where}: the {' and '.join(empty)} reply is empty")
    if identical:
        raise ValueError(f"{where}: chosen and rejected are identical (the pair says nothing)")


def _token_pair(record: dict, vocab_size: int, where: str) -> PairToRender:
    """A pre-tokenized pair: the ids as they are, loss on the reply ids."""
    sides = []
    for name in TOKEN_PAIR_FIELDS:
        value = record.get(name)
        if value is None:
            raise ValueError(f"{where}: a pre-tokenized pair needs {', '.join(TOKEN_PAIR_FIELDS)}; missing {name}")
        segments = token_segments({"input_ids": value}, vocab_size, "all", f"{where}: {name}") or []
        sides.append([Segment(s.text, name != "prompt_input_ids") for s in segments])
    prompt, chosen, rejected = sides
    if not prompt:
        raise ValueError(f"{where}: prompt_input_ids is empty (a sequence's first token carries no loss)")
    ids = [[t for s in side for t in s.text] for side in (chosen, rejected)]
    _check_replies("x" * len(ids[0]), "x" * len(ids[1]), ids[0] == ids[1], where)
    return PairToRender(prompt + chosen, prompt + rejected)


def only_last_replies(segments: list[Segment], turns: int) -> list[Segment]:
    """A rendered chat's segments with loss left on its last ``turns`` loss-carrying pieces (the reply's
    assistant messages); the prompt's earlier assistant turns lose theirs."""
    carrying = [k for k, s in enumerate(segments) if s.loss]
    keep = set(carrying[len(carrying) - turns :]) if turns else set()
    return [s if k in keep or not s.loss else Segment(s.text, False) for k, s in enumerate(segments)]


def join_pair(chosen: tuple[list[int], list[bool]], rejected: tuple[list[int], list[bool]]):
    """The stored example of a pair: both sequences back to back, and where the second starts. The second
    sequence's first token never carries loss (it starts a sequence)."""
    (ids_c, mask_c), (ids_r, mask_r) = chosen, rejected
    return ids_c + ids_r, mask_c + [False] + mask_r[1:], len(ids_c)
