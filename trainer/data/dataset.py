"""Tokenized examples with loss masks, stored flat (one token array, one mask array, offsets).

Rendering a dialog: ``BOS turn_1 EOS turn_2 EOS ... turn_n EOS``. ``loss_on=all`` puts loss on every token
after BOS; ``loss_on=responses`` only on the replies (turns 2, 4, ...) and their EOS. The mask is aligned
with ``input_ids`` (the model shifts), so a token's mask says "this token is predicted". The first token
of an example never carries loss: nothing before it belongs to the same example.

Bad input is never dropped silently: empty dialogs, over-long examples (truncated or dropped, by config)
and examples left with no loss token are counted in ``DatasetStats`` and logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from trainer.config import DataConfig
from trainer.data.sources import Record
from trainer.dist import barrier, is_rank0

log = logging.getLogger(__name__)


@dataclass
class DatasetStats:
    records: int = 0
    examples: int = 0
    dropped_empty: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_no_labels: int = 0
    tokens: int = 0
    label_tokens: int = 0

    def skipped(self) -> int:
        return self.dropped_empty + self.dropped_overlong + self.dropped_no_labels


@dataclass
class TokenizedDataset:
    tokens: np.ndarray
    """All examples' token ids, concatenated (int32)."""
    loss_mask: np.ndarray
    """Per token: does it carry loss (bool, aligned with ``tokens``)."""
    offsets: np.ndarray
    """Example ``i`` is ``tokens[offsets[i]:offsets[i + 1]]`` (int64, length n + 1)."""
    stats: DatasetStats = field(default_factory=DatasetStats)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def label_counts(self) -> np.ndarray:
        """Loss-carrying tokens per example (the first token of each example never counts)."""
        cum = np.concatenate([[0], np.cumsum(self.loss_mask, dtype=np.int64)])
        starts = self.offsets[:-1]
        return cum[self.offsets[1:]] - cum[starts + 1]

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.tokens[lo:hi], self.loss_mask[lo:hi]


def render_dialogs(
    records: list[Record], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, max_length: int
) -> TokenizedDataset:
    """Tokenize dialog records into examples with loss masks, applying the over-length and empty rules."""
    stats = DatasetStats(records=len(records))
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    turns_flat = [t for r in records for t in r.get("turns", [])]
    encoded = tokenizer(turns_flat, add_special_tokens=False)["input_ids"] if turns_flat else []

    token_chunks: list[np.ndarray] = []
    mask_chunks: list[np.ndarray] = []
    lengths: list[int] = []
    pos = 0
    for record in records:
        n_turns = len(record.get("turns", []))
        turn_ids = encoded[pos : pos + n_turns]
        pos += n_turns
        if n_turns == 0 or all(len(t) == 0 for t in turn_ids):
            stats.dropped_empty += 1
            continue
        ids, mask = [bos], [False]
        for k, t in enumerate(turn_ids):
            carries = cfg.loss_on == "all" or k % 2 == 1
            ids += [*t, eos]
            mask += [carries] * (len(t) + 1)
        if len(ids) > max_length:
            if cfg.overlong == "drop":
                stats.dropped_overlong += 1
                continue
            stats.truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask[1:]):
            stats.dropped_no_labels += 1
            continue
        token_chunks.append(np.asarray(ids, dtype=np.int32))
        mask_chunks.append(np.asarray(mask, dtype=bool))
        lengths.append(len(ids))

    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ds = TokenizedDataset(
        tokens=np.concatenate(token_chunks) if token_chunks else np.zeros(0, np.int32),
        loss_mask=np.concatenate(mask_chunks) if mask_chunks else np.zeros(0, bool),
        offsets=offsets,
        stats=stats,
    )
    stats.examples = len(ds)
    stats.tokens = int(offsets[-1])
    stats.label_tokens = int(ds.label_counts().sum()) if len(ds) else 0
    return ds


def log_dataset_stats(name: str, stats: DatasetStats) -> None:
    """Log what was kept and, loudly, what was skipped or truncated."""
    log.info(
        "data %s: %d records -> %d examples, %d tokens, %d label tokens",
        name, stats.records, stats.examples, stats.tokens, stats.label_tokens,
    )
    if stats.skipped() or stats.truncated:
        log.warning(
            "data %s: skipped %d empty, %d over-long, %d with no label token; truncated %d over-long",
            name, stats.dropped_empty, stats.dropped_overlong, stats.dropped_no_labels, stats.truncated,
        )


def build_dataset(
    records_fn, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, max_length: int, cache_key: str
) -> TokenizedDataset:
    """Tokenize once (rank 0) into the cache, then every rank memory-maps the same arrays.

    ``records_fn`` is called only when the cache misses; ``cache_key`` must name everything the result
    depends on besides ``cfg`` and ``max_length`` (the source's identity, the tokenizer).
    """
    key = json.dumps([cache_key, asdict(cfg) | {"cache_dir": None}, max_length], sort_keys=True, default=str)
    path = Path(cfg.cache_dir) / "datasets" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.npz"
    if not path.is_file() and is_rank0():
        ds = render_dialogs(records_fn(), tokenizer, cfg, max_length)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=ds.tokens, loss_mask=ds.loss_mask, offsets=ds.offsets,
                 stats=np.array(json.dumps(asdict(ds.stats))))
        tmp.rename(path)
    barrier()
    with np.load(path) as z:
        stats = DatasetStats(**json.loads(str(z["stats"])))
        ds = TokenizedDataset(z["tokens"], z["loss_mask"], z["offsets"], stats)
    if len(ds) == 0:
        raise ValueError(
            f"data.source={cfg.source}: no usable example ({stats.records} records, {stats.dropped_empty} empty, "
            f"{stats.dropped_overlong} over-long, {stats.dropped_no_labels} without labels)"
        )
    return ds
