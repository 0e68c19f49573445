"""The held-out split: example ``i`` is held out iff ``blake2b(seed, tokens_i)`` read as a number in ``[0, 1)``
falls below ``holdout_fraction``.

It depends on each example's content only, so it is deterministic, the same on every rank, in packed and
padded runs and on the cached and streamed routes (``trainer.data.stream`` applies it chunk by chunk),
disjoint from training by construction, and identical copies of an example always land on the same side (no
leak of a duplicated dialog into eval).
"""

from __future__ import annotations

import numpy as np

from trainer.data.examples import TokenizedDataset

_HASH_SCALE = float(2**64)


def holdout_mask(dataset: TokenizedDataset, fraction: float, seed: int = 0) -> np.ndarray:
    """Boolean per example: is it held out for eval (see the module docstring)."""
    if fraction <= 0:
        return np.zeros(len(dataset), dtype=bool)
    return dataset.content_hashes(seed).astype(np.float64) / _HASH_SCALE < fraction


def subset(dataset: TokenizedDataset, indices: np.ndarray) -> TokenizedDataset:
    """The examples ``indices`` (in that order): a view of the same arrays, never a copy of the tokens."""
    return dataset.select(indices)


def split_holdout(
    dataset: TokenizedDataset, fraction: float, seed: int = 0, max_examples: int | None = None
) -> tuple[TokenizedDataset, TokenizedDataset | None]:
    """(training set, held-out set or ``None`` when ``fraction`` is 0 or nothing was drawn)."""
    held = holdout_mask(dataset, fraction, seed)
    if not held.any():
        return dataset, None
    if held.all():
        raise ValueError(f"eval.holdout_fraction={fraction} held out every one of {len(dataset)} examples")
    eval_idx = np.flatnonzero(held)
    if max_examples is not None:
        eval_idx = eval_idx[:max_examples]
    return subset(dataset, np.flatnonzero(~held)), subset(dataset, eval_idx)


__all__ = ["holdout_mask", "split_holdout", "subset"]
