"""The chunked (fused linear + cross-entropy) loss equals the naive one: the summed loss and every parameter's
gradient, fp32 to 1e-6 and bf16 to bf16's precision; packed and padded batches, ignore_index labels, tied and
untied heads, several chunks, eval, and families that scale or softcap their logits. A family whose logits the
chunk cannot reproduce falls back to naive, saying so."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trainer.collate import collate_packed, collate_padded
from trainer.data.examples import IGNORE_INDEX
from trainer.data.holdout import subset
from trainer.evaluate import evaluate
from trainer.loss import LogitTransform, chunked_summed_loss, chunked_token_logps, summed_token_loss
from trainer.model import VarlenCausalLM, resolve_backend

CPU = torch.device("cpu")
VOCAB = 97
LLAMA_LIKE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
FAMILIES = {
    "gpt2_tied": (
        "gpt2",
        dict(n_layer=2, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    ),
    "qwen2_untied": ("qwen2", dict(LLAMA_LIKE, tie_word_embeddings=False)),
    "gemma2_softcap": (
        "gemma2",
        dict(LLAMA_LIKE, head_dim=8, final_logit_softcapping=2.0, attn_logit_softcapping=None),
    ),
    "cohere_scale": ("cohere", dict(LLAMA_LIKE, logit_scale=0.5)),
    "granite_scaling": ("granite", dict(LLAMA_LIKE, logits_scaling=3.0)),
}
LENGTHS = [9, 1, 14, 5, 11, 3]


def tiny_model(key: str, dtype=torch.float32) -> VarlenCausalLM:
    family, overrides = FAMILIES[key]
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return VarlenCausalLM(model, resolve_backend("sdpa_varlen", CPU))


def packed_inputs(seed: int = 0) -> tuple[dict, torch.Tensor]:
    """A packed batch of LENGTHS with labels masked here and there (and every example's first token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, sum(LENGTHS)), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.3] = IGNORE_INDEX
    cu = torch.tensor(np.cumsum([0, *LENGTHS]), dtype=torch.int32)
    labels[0, cu[:-1].long()] = IGNORE_INDEX
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return dict(input_ids=ids, position_ids=positions, cu_seqlens=cu, max_seqlen=max(LENGTHS)), labels


def loss_and_grads(model: VarlenCausalLM, inputs: dict, labels: torch.Tensor, scale: float = 0.01):
    model.zero_grad()
    loss = model.token_loss(**inputs, labels=labels)
    (loss * scale).backward()  # a loss divided by the global label count, as the trainer does
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(naive, chunked, atol: float, rtol: float) -> None:
    torch.testing.assert_close(chunked[0], naive[0], atol=atol * 100, rtol=rtol)
    for name, grad in naive[1].items():
        torch.testing.assert_close(
            chunked[1][name], grad, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("key", list(FAMILIES))
def test_chunked_matches_naive_fp32(key):
    model = tiny_model(key)
    inputs, labels = packed_inputs()
    assert model.use_loss("naive") == "naive"
    naive = loss_and_grads(model, inputs, labels)
    assert model.use_loss("chunked", chunk_tokens=7) == "chunked (torch)"  # several chunks, a short last one
    chunked = loss_and_grads(model, inputs, labels)
    assert_same(naive, chunked, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("key", ["gpt2_tied", "qwen2_untied"])
def test_chunked_matches_naive_bf16(key):
    model = tiny_model(key, dtype=torch.bfloat16)
    inputs, labels = packed_inputs()
    model.use_loss("naive")
    naive = loss_and_grads(model, inputs, labels, scale=1.0)
    model.use_loss("chunked", chunk_tokens=16)
    chunked = loss_and_grads(model, inputs, labels, scale=1.0)
    torch.testing.assert_close(chunked[0], naive[0], atol=0.05, rtol=1e-2)
    for name, grad in naive[1].items():  # bf16 rounds each gradient element to ~3 significant digits
        err = (chunked[1][name].float() - grad.float()).norm() / grad.float().norm().clamp_min(1e-12)
        assert err < 2e-2, f"{name}: relative error {err:.3g}"


def test_padded_batch_and_eval_match(tokenizer, small_dataset):
    """The padded baseline's batches (pads as -100) and no-grad eval through ``evaluate``."""
    from tests.conftest import tiny_gpt2_config
    from trainer.model import build_model

    model = build_model(tiny_gpt2_config(), tokenizer, resolve_backend("sdpa_varlen", CPU), seed=0)
    padded = collate_padded(small_dataset, np.arange(6), tokenizer.pad_token_id)
    packed = collate_packed(small_dataset, np.arange(6))
    held_out = subset(small_dataset, np.arange(12))
    results = {}
    for impl in ("naive", "chunked"):
        model.use_loss(impl, chunk_tokens=50)
        with torch.no_grad():
            results[impl] = [summed_token_loss(model, b) for b in (padded, packed)]
        results[impl].append(evaluate(model, held_out, 256, CPU, tokenizer.pad_token_id)["eval_loss"])
    torch.testing.assert_close(results["chunked"][:2], results["naive"][:2], atol=1e-4, rtol=1e-6)
    assert results["chunked"][2] == pytest.approx(results["naive"][2], rel=1e-6)


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.3, softcap=1.5)])
def test_function_matches_reference_with_bias(transform):
    """The autograd function alone, with a head bias (no family here has one) and a transform."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=g, requires_grad=True)
    bias = torch.randn(VOCAB, generator=g, requires_grad=True)
    targets = torch.randint(0, VOCAB, (23,), generator=g)
    reference = torch.nn.functional.cross_entropy(
        transform.apply(torch.nn.functional.linear(hidden, weight, bias))[0], targets, reduction="sum"
    )
    ref_grads = torch.autograd.grad(reference / 7, (hidden, weight, bias))
    ours = chunked_summed_loss(hidden, weight, bias, targets, transform, chunk_tokens=5)
    our_grads = torch.autograd.grad(ours / 7, (hidden, weight, bias))
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-6)
    for a, b in zip(our_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.3, softcap=1.5)])
def test_token_logps_match_reference_with_bias(transform):
    """The per-token terms (DPO's log-probs): values in forward, each chunk recomputed in backward and weighted
    by its tokens' incoming gradient."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=g, requires_grad=True)
    bias = torch.randn(VOCAB, generator=g, requires_grad=True)
    targets = torch.randint(0, VOCAB, (23,), generator=g)
    upstream = torch.randn(23, generator=g)  # a token's gradient known only after the pair losses
    logits = transform.apply(torch.nn.functional.linear(hidden, weight, bias))[0]
    reference = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    ref_grads = torch.autograd.grad((reference * upstream).sum(), (hidden, weight, bias))
    ours = chunked_token_logps(hidden, weight, bias, targets, transform, chunk_tokens=5)
    our_grads = torch.autograd.grad((ours * upstream).sum(), (hidden, weight, bias))
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-6)
    for a, b in zip(our_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_unknown_logit_change_falls_back_to_naive():
    """A family that changes its logits in a way the chunk does not know is refused, not silently wrong."""
    model = tiny_model("qwen2_untied")
    head = model.model.get_output_embeddings()
    original = head.forward
    head.forward = lambda x: original(x) * 2.0  # the logits are no longer head(hidden)
    line = model.use_loss("chunked")
    assert line.startswith("naive (chunked refused:") and "Qwen2ForCausalLM" in line
    assert model.loss.impl == "naive"


def test_a_head_with_parameters_of_its_own_falls_back_to_naive():
    """Dory's head multiplies the logits by a learned ``logit_scale`` initialised to leave them unchanged:
    the logit probe agrees at init, but the chunked loss would never train the scale."""
    model = tiny_model("qwen2_untied")
    head = model.model.get_output_embeddings()
    head.logit_scale = torch.nn.Parameter(torch.ones(head.out_features))
    original = head.forward
    head.forward = lambda x: original(x) * head.logit_scale
    line = model.use_loss("chunked")
    assert line.startswith("naive (chunked refused:") and "logit_scale" in line, line
    assert model.loss.impl == "naive"


def test_all_labels_masked_gives_zero_loss_and_gradient():
    model = tiny_model("gpt2_tied")
    model.use_loss("chunked")
    inputs, labels = packed_inputs()
    loss, grads = loss_and_grads(model, inputs, torch.full_like(labels, IGNORE_INDEX))
    assert loss.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())
