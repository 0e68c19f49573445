"""Example-length distributions for benchmarks, reports and tests (no tokenizer, no text).

- ``dailydialog_like_lengths``: tokens per rendered dialog (``BOS turn EOS turn EOS ...``) drawn from the same
  turn-count and turn-length distributions as the generated corpus (``trainer.data.synthetic``):
  7.9 turns of 14.6 tokens on average, right-skewed, a few hundred tokens at most.
- ``heavy_tailed_lengths``: a Pareto tail (alpha 1.3): most examples short, a few very long (long documents
  mixed with chat), the hard case for packing and for rank balance.
- ``ultrafeedback_like_pairs``: preference pairs' prompt / chosen / rejected lengths (log-normal, medians
  150 / 250 / 250, a tail to 1.5k; an assumption, not measured on UltraFeedback): ``benchmarks/dpo.py``'s pairs.
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


def ultrafeedback_like_pairs(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Tokens of each pair's ``prompt``, ``chosen`` and ``rejected`` (drawn from ``rng`` in that order): the prompt
    log-normal with median 150 (sigma 0.6, 8..512), each reply median 250 (sigma 0.7, 4..1536), independent."""
    return {"prompt": np.clip(rng.lognormal(np.log(150), 0.6, n), 8, 512).astype(int),
            "chosen": np.clip(rng.lognormal(np.log(250), 0.7, n), 4, 1536).astype(int),
            "rejected": np.clip(rng.lognormal(np.log(250), 0.7, n), 4, 1536).astype(int)}


WORKLOADS = {"dailydialog_like": dailydialog_like_lengths, "heavy_tailed": heavy_tailed_lengths}
