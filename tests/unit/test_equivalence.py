"""Contract 1: a packed batch gives the same logits and gradients as its examples run one by one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import tiny_gpt2_config
from trainer.collate import collate_packed, collate_padded
from trainer.data.examples import IGNORE_INDEX
from trainer.model import build_model, resolve_backend

CPU = torch.device("cpu")


def _loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


@pytest.mark.parametrize("backend", ["sdpa_varlen", "sdpa_block_mask"])
def test_packed_matches_one_by_one(backend, tokenizer, small_dataset):
    model = build_model(tiny_gpt2_config(), tokenizer, resolve_backend(backend, CPU), seed=0).eval()
    lengths = small_dataset.lengths
    # examples of clearly different lengths, including the shortest and the longest
    order = np.argsort(lengths)
    indices = np.array([order[0], order[len(order) // 2], order[-1], order[len(order) // 4], order[1]])
    assert len(set(lengths[indices].tolist())) >= 4

    packed = collate_packed(small_dataset, indices)
    model.zero_grad()
    logits = model(**packed.model_inputs())
    _loss_sum(logits, packed.labels).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    ref_logits = []
    for i in indices:
        single = collate_padded(small_dataset, np.array([i]), tokenizer.pad_token_id)
        out = model(**single.model_inputs())
        _loss_sum(out, single.labels).backward()  # gradients accumulate over the examples
        ref_logits.append(out[0])

    torch.testing.assert_close(logits[0], torch.cat(ref_logits), atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, atol=1e-5, rtol=1e-5, msg=f"gradient of {name}")


def test_padded_batch_matches_one_by_one(tokenizer, small_dataset):
    """The padded baseline computes the same loss: pads are masked in attention and in the labels."""
    model = build_model(tiny_gpt2_config(), tokenizer, resolve_backend("sdpa_varlen", CPU), seed=0).eval()
    indices = np.arange(6)
    padded = collate_padded(small_dataset, indices, tokenizer.pad_token_id)
    packed = collate_packed(small_dataset, indices)
    with torch.no_grad():
        loss_padded = _loss_sum(model(**padded.model_inputs()), padded.labels)
        loss_packed = _loss_sum(model(**packed.model_inputs()), packed.labels)
    assert padded.num_label_tokens == packed.num_label_tokens
    torch.testing.assert_close(loss_padded, loss_packed, atol=1e-4, rtol=1e-5)


def test_packed_attention_refuses_missing_boundaries(tokenizer):
    """No silent fallback: a packed backend never attends over a whole row without boundaries."""
    from trainer.model import AttentionBackendError
    from trainer.model.attention import sdpa_varlen_attention

    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(AttentionBackendError, match="cu_seq_lens_q"):
        sdpa_varlen_attention(None, q, q, q, None)
