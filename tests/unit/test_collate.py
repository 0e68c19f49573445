"""Collate: position_ids, labels at boundaries and cu_seqlens on a hand-made example."""

from __future__ import annotations

import numpy as np
import torch

from trainer.collate import collate_packed, collate_padded
from trainer.data.examples import IGNORE_INDEX, TokenizedDataset


def _dataset() -> TokenizedDataset:
    # example 0: 4 tokens, all carry loss; example 1: 3 tokens, last two carry loss; example 2: 2 tokens
    tokens = np.array([10, 11, 12, 13, 20, 21, 22, 30, 31], dtype=np.int32)
    mask = np.array([0, 1, 1, 1, 0, 0, 1, 0, 1], dtype=bool)
    return TokenizedDataset(tokens, mask, np.array([0, 4, 7, 9]))


def test_packed_batch_fields():
    b = collate_packed(_dataset(), np.array([0, 1, 2]))
    assert b.input_ids.tolist() == [[10, 11, 12, 13, 20, 21, 22, 30, 31]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]
    X = IGNORE_INDEX
    assert b.labels.tolist() == [[X, 11, 12, 13, X, X, 22, X, 31]]
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens.tolist() == [0, 4, 7, 9]
    assert b.max_seqlen == 4
    assert (b.num_examples, b.num_tokens, b.num_positions, b.num_label_tokens) == (3, 9, 9, 5)
    assert b.attention_mask is None


def test_first_token_of_every_example_has_no_label_even_if_masked_in():
    ds = _dataset()
    ds.loss_mask[:] = True  # every token "carries loss"...
    b = collate_packed(ds, np.array([2, 0, 1]))
    starts = b.cu_seqlens[:-1].tolist()
    assert all(b.labels[0, s] == IGNORE_INDEX for s in starts)  # ...but never across a boundary
    assert b.num_label_tokens == 9 - 3


def test_padded_batch_fields():
    b = collate_padded(_dataset(), np.array([1, 0]), pad_id=0)
    X = IGNORE_INDEX
    assert b.input_ids.tolist() == [[20, 21, 22, 0], [10, 11, 12, 13]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert b.labels.tolist() == [[X, X, 22, X], [X, 11, 12, 13]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert (b.num_tokens, b.num_positions, b.num_label_tokens) == (7, 8, 4)


def test_empty_microbatch_is_a_labelless_filler():
    b = collate_packed(_dataset(), np.zeros(0, dtype=np.int64))
    assert b.num_label_tokens == 0 and b.num_tokens == 0 and b.input_ids.shape == (1, 1)
    assert (b.labels == IGNORE_INDEX).all()
