"""Held-out split and packed eval: deterministic, disjoint, and equal to one-by-one eval."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import tiny_gpt2_config
from trainer.collate import collate_packed, collate_padded
from trainer.data.examples import IGNORE_INDEX
from trainer.data.holdout import holdout_mask, split_holdout, subset
from trainer.evaluate import eval_microbatches, evaluate
from trainer.model import build_model, resolve_backend


def _examples(ds):
    return [tuple(map(np.ndarray.tolist, ds.example(i))) for i in range(len(ds))]


def test_holdout_split_is_deterministic_disjoint_and_complete(small_dataset):
    train, held = split_holdout(small_dataset, 0.2, seed=3)
    train2, held2 = split_holdout(small_dataset, 0.2, seed=3)
    assert _examples(held) == _examples(held2) and _examples(train) == _examples(train2)
    assert len(train) + len(held) == len(small_dataset)
    assert 0.1 * len(small_dataset) < len(held) < 0.3 * len(small_dataset)
    mask = holdout_mask(small_dataset, 0.2, seed=3)
    assert _examples(held) == _examples(subset(small_dataset, np.flatnonzero(mask)))
    assert _examples(train) == _examples(subset(small_dataset, np.flatnonzero(~mask)))
    # Another salt draws another set; fraction 0 turns eval off.
    assert not np.array_equal(mask, holdout_mask(small_dataset, 0.2, seed=4))
    assert split_holdout(small_dataset, 0.0)[1] is None


def test_holdout_depends_on_content_so_duplicates_never_straddle(small_dataset):
    twice = subset(small_dataset, np.concatenate([np.arange(len(small_dataset))] * 2))
    mask = holdout_mask(twice, 0.3)
    n = len(small_dataset)
    assert np.array_equal(mask[:n], mask[n:])
    assert np.array_equal(mask[:n], holdout_mask(small_dataset, 0.3))


def test_eval_microbatches_cover_every_example_once_with_equal_counts(small_dataset):
    lengths = small_dataset.lengths
    for world in (1, 2, 3):
        per_rank = [eval_microbatches(lengths, 512, r, world) for r in range(world)]
        assert len({len(p) for p in per_rank}) == 1
        seen = np.sort(np.concatenate([b for p in per_rank for b in p]))
        assert np.array_equal(seen, np.arange(len(lengths)))
    # Examples longer than the budget (splitting strategies) stay whole: the eval bins grow to the longest.
    budget = int(np.sort(lengths)[-3])
    bins = eval_microbatches(lengths, budget, 0, 1)
    assert bins[0].ndim == 1 and np.array_equal(np.sort(np.concatenate(bins)), np.arange(len(lengths)))
    assert max(int(lengths[b].sum()) for b in bins) <= lengths.max()


def test_packed_eval_loss_equals_one_by_one(small_dataset, tokenizer):
    """Packed eval (several examples per row, fp32) == the same examples run alone, unpacked."""
    held = subset(small_dataset, np.arange(40))
    model = build_model(tiny_gpt2_config(), tokenizer, resolve_backend("auto", torch.device("cpu")), seed=0)
    packed = evaluate(model, held, token_budget=384, device=torch.device("cpu"), pad_id=tokenizer.pad_token_id)
    assert len(eval_microbatches(held.lengths, 384, 0, 1)) < len(held)  # really packed, several per row

    loss_sum, labels = 0.0, 0
    with torch.no_grad():
        for i in range(len(held)):  # each example alone, as a plain unpacked sequence
            batch = collate_padded(held, np.array([i]), tokenizer.pad_token_id)
            logits = model(**batch.model_inputs())
            loss_sum += F.cross_entropy(
                logits[0, :-1].double(), batch.labels[0, 1:], ignore_index=IGNORE_INDEX, reduction="sum"
            ).item()
            labels += batch.num_label_tokens
    assert packed["eval_tokens"] == labels == int(held.label_counts().sum())
    assert packed["eval_loss"] == pytest.approx(loss_sum / labels, rel=1e-5)


def test_padded_equivalent_positions(small_dataset):
    idx = np.array([0, 1, 2, 3])
    lengths = small_dataset.lengths[idx]
    packed = collate_packed(small_dataset, idx)
    padded = collate_padded(small_dataset, idx, 0)
    assert packed.padded_positions == 4 * lengths.max() == padded.num_positions
    assert padded.padded_positions == padded.num_positions
    assert packed.sum_squared_lengths == padded.sum_squared_lengths == int((lengths**2).sum())
    assert collate_packed(small_dataset, np.array([], dtype=np.int64)).padded_positions == 1
