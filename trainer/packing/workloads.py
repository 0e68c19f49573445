"""Example-length distributions for benchmarks, reports and tests (no tokenizer, no text).

- ``dailydialog_like_lengths``: tokens per rendered dialog (``BOS turn EOS turn EOS ...``) drawn from the same
  turn-count and turn-length distributions as the generated corpus (``trainer.data.synthetic``):
  7.9 turns of 14.6 tokens on average, right-skewed, a few hundred tokens at most.
- ``heavy_tailed_lengths``: a Pareto tail (alpha 1.3): most examples short, a few very long (long documents
  mixed with chat), the hard case for packing and for rank balance.
"""

from __future__ import annotations

import numpy as np

from trainer.data.synthetic import _dialog_turns, _turn_lengths


def dailydialog_like_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    turns = _dialog_turns(rng, n)
    per_turn = _turn_lengths(rng, int(turns.sum())) + 1  # + EOS
    starts = np.r_[0, np.cumsum(turns)[:-1]]
    return 1 + np.add.reduceat(per_turn, starts)  # + BOS


def heavy_tailed_lengths(n: int, seed: int = 0, scale: int = 64, alpha: float = 1.3, cap: int = 65536) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(np.ceil(scale * (1 + rng.pareto(alpha, size=n))), cap).astype(np.int64)


WORKLOADS = {"dailydialog_like": dailydialog_like_lengths, "heavy_tailed": heavy_tailed_lengths}
