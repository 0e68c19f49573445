"""``objective=distill`` in one process: the startup self-check's distillation loss passes a packed batch (whole
examples and split pieces, a live teacher or its top-k) and fails a teacher that leaks between examples while
the student's logits are right; packed == padded and chunked == naive through the objective; a filler batch is
exactly 0; what cannot be distilled is refused in one line (another vocabulary, another head, a missing folder,
context parallelism, a stored top-k without a data cache, settings out of range)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import compose_job
from trainer.collate import _empty_batch, collate_packed, collate_padded
from trainer.config import ConfigError
from trainer.data import load_dataset, load_tokenizer
from trainer.model import build_model, measure, resolve_backend
from trainer.objectives.distill import Distill
from trainer.objectives.distill import check as check_module
from trainer.packing import piece_starts

CPU = torch.device("cpu")
RECORDS = ["data.num_records=120", "model.tokenizer_vocab_size=512"]


def save_teacher(folder, tokenizer, vocab: int | None = None):
    """A random Qwen2 of another shape than cpu_distill's student, with ``tokenizer``, as a model folder."""
    torch.manual_seed(3)
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=vocab or len(tokenizer),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        initializer_range=0.1,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = compose_job(["recipe=cpu_chat_sft", *RECORDS])
    tokenizer = load_tokenizer(base.model, base.data)
    teacher = save_teacher(tmp_path_factory.mktemp("teacher"), tokenizer)
    cfg = compose_job(["recipe=cpu_distill", *RECORDS, f"distill.teacher={teacher}", "distill.top_k=6"])
    dataset = load_dataset(cfg.data, tokenizer, 512)
    return cfg, tokenizer, dataset


def student(cfg, tokenizer, impl: str = "chunked"):
    model = build_model(cfg.model, tokenizer, resolve_backend("sdpa_varlen", CPU), seed=5)
    model.use_loss(impl, chunk_tokens=9)  # several chunks
    return model


def objective(cfg, model, **distill):
    return Distill(dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, **distill)), model)


def batches(dataset):
    order = np.argsort(dataset.lengths)
    whole = order[[0, 10, 40, 80, -1]]
    longest = int(order[-1])
    pieces = np.array(
        [
            [longest, 0, 30],
            [int(order[0]), 0, int(dataset.lengths[order[0]])],
            [longest, 30, int(dataset.lengths[longest])],
            [int(order[50]), 0, int(dataset.lengths[order[50]])],
        ]
    )
    return collate_packed(dataset, whole), collate_packed(dataset, pieces), whole, piece_starts(pieces)


@pytest.mark.parametrize("teacher_logits", ["live", "precompute"])
def test_self_check_passes_a_packed_batch_and_catches_a_leaking_teacher(setup, teacher_logits, monkeypatch):
    cfg, tokenizer, dataset = setup
    model = student(cfg, tokenizer)
    check = objective(cfg, model, teacher_logits=teacher_logits, divergence="jsd", beta=0.3).check_loss()
    assert check.describe().startswith("distill jsd loss")
    whole, pieces, _, starts = batches(dataset)
    for batch, first in ((whole, None), (pieces, starts)):  # whole examples, then split pieces
        result = measure(model, batch, starts=first, loss=check)
        assert result.ok and result.grad_gap < 1e-5, result.line()

    real = check_module.live_teacher if teacher_logits == "live" else check_module.teacher_top_k

    def leaking(teacher, batch, *args):  # the teacher's pass attends across the row's examples
        ones = torch.ones_like(batch.input_ids)
        return real(teacher, dataclasses.replace(batch, cu_seqlens=None, attention_mask=ones), *args)

    monkeypatch.setattr(check_module, "live_teacher" if teacher_logits == "live" else "teacher_top_k", leaking)
    result = measure(model, batches(dataset)[0], loss=check)
    assert result.logit_diff <= result.logit_tolerance and result.grad_gap > result.grad_tolerance, result.line()


def test_packed_equals_padded_and_chunked_equals_naive(setup):
    """The objective's loss and gradient: a packed row == the same examples padded == the naive student."""
    cfg, tokenizer, dataset = setup
    packed, _, whole, _ = batches(dataset)
    padded = collate_padded(dataset, whole, tokenizer.pad_token_id)
    results = []
    for impl, batch in (("chunked", packed), ("chunked", padded), ("naive", packed)):
        model = student(cfg, tokenizer, impl)
        distill = objective(cfg, model, divergence="reverse_kl", temperature=1.7, alpha=0.3)
        loss = distill.loss_sum(model, batch)
        loss.backward()
        results.append((loss.detach(), distill.sums, [p.grad.clone() for p in model.parameters()]))
    for loss, sums, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(sums, results[0][1], rtol=1e-5, atol=1e-4)
        for a, b in zip(grads, results[0][2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_heads_read_hidden_states_of_another_dtype_in_their_own(setup):
    """A student and a live teacher whose last hidden states are in another dtype than their heads (as Mamba's fp32
    residual stream under a bf16 head; here the final norm in fp64 before an fp32 head): the same terms and
    gradients as with every weight in fp32."""
    cfg, tokenizer, dataset = setup
    packed = batches(dataset)[0]
    results = []
    for norm_dtype in (torch.float32, torch.float64):
        model = student(cfg, tokenizer)
        distill = objective(cfg, model, teacher_logits="live", divergence="jsd", beta=0.3, alpha=0.3)
        for m in (model, distill.teacher):
            m.model.model.norm.to(norm_dtype)
        loss = distill.loss_sum(model, packed)
        loss.backward()
        results.append((distill.sums, [p.grad.float() for p in model.parameters()]))
    (sums, grads), (wide_sums, wide_grads) = results
    torch.testing.assert_close(wide_sums, sums, rtol=1e-5, atol=1e-4)
    for a, b in zip(wide_grads, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_filler_batch_is_exactly_zero(setup):
    cfg, tokenizer, _ = setup
    model = student(cfg, tokenizer)
    loss = objective(cfg, model).loss_sum(model, _empty_batch(tokenizer.pad_token_id))
    loss.backward()
    assert float(loss.detach()) == 0.0 and all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())


def test_a_teacher_that_cannot_be_distilled_from_is_refused_in_one_line(setup, tmp_path):
    cfg, tokenizer, _ = setup
    model = student(cfg, tokenizer)
    other = load_tokenizer(dataclasses.replace(cfg.model, tokenizer_vocab_size=300), cfg.data)
    wrong_vocab = save_teacher(tmp_path / "vocab", other)
    with pytest.raises(ConfigError, match=r"its tokenizer is not the student's \(\d+ tokens vs \d+;") as caught:
        objective(cfg, model, teacher=wrong_vocab)
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="distill.teacher=./no/such/teacher: no such folder; train and export"):
        objective(cfg, model, teacher="./no/such/teacher")
    wrong_rows = save_teacher(tmp_path / "rows", tokenizer, vocab=len(tokenizer) + 8)
    with pytest.raises(ConfigError, match="its head has .* output rows, the student's"):
        objective(cfg, model, teacher=wrong_rows)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["distill.teacher=null"], "objective=distill needs a teacher"),
        (["parallel.cp=2"], "objective=distill cannot be combined with parallel.cp=2"),
        (
            ["distill.teacher_logits=precompute", "data.stream.enabled=true", "max_steps=3"],
            "cannot be combined with data.stream.enabled=true with distill.teacher_logits=precompute",
        ),
        (["distill.divergence=jsd", "distill.beta=1.0"], r"distill.beta must be in \(0, 1\)"),
        (["distill.alpha=1.5"], r"distill.alpha must be in \[0, 1\]"),
    ],
)
def test_config_refusals(setup, overrides, match):
    cfg, _, _ = setup
    with pytest.raises(ConfigError, match=match):
        compose_job(["recipe=cpu_distill", *RECORDS, f"distill.teacher={cfg.distill.teacher}", *overrides])
