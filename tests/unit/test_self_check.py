"""The startup self-check passes on a correct model and stops a leaky backend or broken positions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from tests.conftest import tiny_gpt2_config
from trainer.collate import collate_packed, collate_padded
from trainer.model import SelfCheckError, build_model, resolve_backend, self_check
from trainer.model.selfcheck import run_startup_self_check


def leaky_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The classic packing bug: causal attention over the whole row, boundaries ignored."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2), None


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_model(tiny_gpt2_config(), tokenizer, resolve_backend("sdpa_varlen", torch.device("cpu")), seed=0)


INDICES = np.array([3, 17, 42, 5])


def test_packed_and_padded_pass(model, small_dataset, tokenizer):
    for collate in (collate_packed, collate_padded):
        result = self_check(model, collate(small_dataset, INDICES, tokenizer.pad_token_id))
        assert result.ok and result.max_logit_diff < 1e-5, result.line()
    run_startup_self_check(model, collate_packed(small_dataset, INDICES, tokenizer.pad_token_id), None, None)


def test_leaky_backend_stops_the_run(model, small_dataset, tokenizer):
    AttentionInterface.register("packfsdp_leaky", leaky_attention)
    leaky = dataclasses.replace(model.backend, name="leaky", fn=leaky_attention)
    good = model.backend
    model.backend = leaky
    try:
        with pytest.raises(SelfCheckError, match=r"max \|logit diff\| .* over tolerance"):
            run_startup_self_check(model, collate_packed(small_dataset, INDICES, tokenizer.pad_token_id), None, None)
    finally:
        model.backend = good


def test_positions_that_do_not_restart_are_caught(model, small_dataset, tokenizer):
    batch = collate_packed(small_dataset, INDICES, tokenizer.pad_token_id)
    batch.position_ids = torch.arange(batch.num_tokens)[None]
    with pytest.raises(SelfCheckError, match="do not restart"):
        self_check(model, batch)


def test_split_pieces_keep_their_offsets(model, small_dataset, tokenizer):
    """packing=bfd_split|wrapped: a piece's positions continue inside its example; that passes, and a
    piece whose positions were reset to 0 is caught."""
    pieces = np.array([[3, 0, 10], [17, 5, 20], [42, 2, 9]])
    batch = collate_packed(small_dataset, pieces, tokenizer.pad_token_id)
    run_startup_self_check(model, batch, None, None, pieces)
    with pytest.raises(SelfCheckError, match="do not restart at 5"):
        broken = collate_packed(small_dataset, pieces, tokenizer.pad_token_id)
        broken.position_ids[0, 10:25] = torch.arange(15)
        self_check(model, broken, starts=[0, 5, 2])
