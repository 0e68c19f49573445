"""Pre-tokenized records: rows that already hold ``input_ids`` (the output of a user's own preprocessing).

A row carries ``input_ids`` and, to say which tokens carry loss, one of:

- ``labels``: Hugging Face's convention, the ids themselves where a token is predicted and -100 where it
  is not, *unshifted* (the model shifts: position t predicts ``labels[t + 1]``);
- ``loss_mask``: 1/0 (or true/false) per token;
- neither: every token carries loss (a document).

An ``attention_mask`` column, if present, marks padding the preprocessing added: its 0s must sit at one end
of the row and are stripped (a 0 in the middle would be a hole in the example). The tokens are used as they
are: no BOS/EOS is added, and, as for rendered text, an example's first token never carries loss.

Everything is checked against the tokenizer the run uses (ids inside its vocabulary, columns of one length,
labels aligned with the ids); a row that fails names its file and line (``data.on_bad_record``).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer.data.chat import Segment
from trainer.data.examples import IGNORE_INDEX

TOKEN_FIELDS = ("input_ids", "labels", "loss_mask", "attention_mask")
"""The columns of a pre-tokenized row (``data.columns`` may map them to other names)."""


def token_segments(record: dict, vocab_size: int, loss_on: str, where: str) -> list[Segment] | None:
    """The pieces of a pre-tokenized record: runs of tokens with the same loss flag (``None``: no tokens).
    ``loss_on=all`` puts loss on every token whatever the labels say."""
    ids = _int_list(record["input_ids"], "input_ids", where)
    columns = {name: _int_list(record[name], name, where) for name in TOKEN_FIELDS[1:] if record.get(name) is not None}
    for name, values in columns.items():
        if len(values) != len(ids):
            raise ValueError(f"{where}: {name} has {len(values)} values but input_ids has {len(ids)}")
    keep = _unpadded(columns.get("attention_mask"), where)
    ids = ids[keep]
    if not ids:
        return None
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"{where}: input_ids holds {bad}, outside the tokenizer's vocabulary (0..{vocab_size - 1}); "
            "was the data tokenized with another tokenizer?"
        )
    if loss_on == "all":
        mask = [True] * len(ids)
    elif "labels" in columns:
        mask = _labels_mask(ids, columns["labels"][keep], where)
    elif "loss_mask" in columns:
        mask = [bool(v) for v in columns["loss_mask"][keep]]
    else:
        mask = [True] * len(ids)
    return _runs(ids, mask)


def _int_list(value, name: str, where: str) -> list[int]:
    if hasattr(value, "tolist"):  # numpy / Arrow arrays
        value = value.tolist()
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"{where}: {name} must be a list of integers, got {type(value).__name__}")
    ids_like = name in ("input_ids", "labels")  # token ids; the masks may be booleans (bool is an int)
    if any(not isinstance(v, int) or (ids_like and isinstance(v, bool)) for v in value):
        kinds = sorted({type(v).__name__ for v in value})
        raise ValueError(f"{where}: {name} must hold integers only, got {', '.join(kinds)}")
    return [int(v) for v in value]


def _unpadded(attention_mask: list[int] | None, where: str) -> slice:
    """The slice of real tokens: the 1s of ``attention_mask``, which must be one contiguous run."""
    if attention_mask is None:
        return slice(None)
    ones = [i for i, v in enumerate(attention_mask) if v]
    if not ones:
        return slice(0, 0)
    if ones[-1] - ones[0] + 1 != len(ones):
        raise ValueError(f"{where}: attention_mask has 0s between tokens; only padding at either end can be removed")
    return slice(ones[0], ones[-1] + 1)


def _labels_mask(ids: list[int], labels: list[int], where: str) -> list[bool]:
    for i, (token, label) in enumerate(zip(ids, labels, strict=True)):
        if label != IGNORE_INDEX and label != token:
            shifted = all(lab in (IGNORE_INDEX, nxt) for lab, nxt in zip(labels[:-1], ids[1:], strict=True))
            hint = " (they look shifted by one: give them unshifted, the model shifts)" if shifted else ""
            raise ValueError(
                f"{where}: labels[{i}]={label} but input_ids[{i}]={token}; labels must equal input_ids where a "
                f"token carries loss and be {IGNORE_INDEX} elsewhere{hint}"
            )
    return [label != IGNORE_INDEX for label in labels]


def _runs(ids: list[int], mask: list[bool]) -> list[Segment]:
    """Consecutive tokens with the same loss flag as one ready-made segment each."""
    segments: list[Segment] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            segments.append(Segment(ids[start:i], mask[start]))
            start = i
    return segments
