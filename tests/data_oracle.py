"""The tests' in-memory oracle of the data route: records rendered by the one renderer and stored flat in
memory, with the counts every route reports (``trainer.data.render``, ``trainer.data.examples``). The cached
and streamed routes must give the same examples; tests compare them against this."""

from __future__ import annotations

import numpy as np
from transformers import PreTrainedTokenizerBase

from trainer.config import DataConfig
from trainer.data.bad_records import BadRecords
from trainer.data.examples import TokenizedDataset, from_examples
from trainer.data.render import Outcome, render_outcomes, stats_of


def render_records(
    records: list, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, max_length: int
) -> TokenizedDataset:
    """``records`` rendered in one chunk, over-length and empty rules applied, kept in memory."""
    bad = BadRecords(cfg.on_bad_record, cfg.source)
    rendered = render_outcomes(records, tokenizer, cfg, max_length, bad)
    bad.finish([])
    stats = stats_of(np.array([outcome for _, _, outcome, _ in rendered], dtype=np.int8))
    stats.dropped_bad += getattr(records, "skipped_bad", 0)
    return from_examples([(ids, mask) for ids, mask, outcome, _ in rendered if outcome <= Outcome.TRUNCATED], stats)
