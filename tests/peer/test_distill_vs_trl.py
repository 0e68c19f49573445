"""packfsdp's packed distillation loss == TRL's GKD loss (an implementation no one here wrote), on the same
weights and examples: the loss and every student gradient of one step, fp32 1e-5. Runs when the ``peer`` extra
(trl==1.16.0) is installed; skipped otherwise.

The TRL code compared, by name (trl 1.16.0, ``trl/experimental/gkd/gkd_trainer.py``): ``GKDTrainer.compute_loss``
(the student's and the teacher's full logits of the padded batch, shifted by one, ``labels`` -100 where no
loss) -> ``GKDTrainer.generalized_jsd_loss`` (``F.kl_div`` per vocabulary entry: ``beta=0`` forward KL
``KL(teacher || student)``, ``beta=1`` reverse KL, otherwise the generalized JSD of the mixture
``(1 - beta) student + beta teacher``; masked, summed, divided by the label count: ``batchmean``). Its
``compute_loss`` passes no temperature (1.0): the temperature cases call ``generalized_jsd_loss`` on the same
shifted logits with ``temperature=``.

packfsdp's side: the same examples in one packed row (``collate_packed``), the teacher's pass over it and the
student's chunked distillation loss (``trainer.objectives.distill``: ``live_teacher``, ``student_terms``, the
path ``Distill.loss_sum`` runs) at ``alpha=0`` (TRL's GKD has no cross-entropy term), over the label count.
The teacher is a Qwen2 of another shape than the student, with the student's tokenizer.
"""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl", reason="the peer extra is not installed (pip install -e .[peer])")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from trl.experimental.gkd import GKDTrainer  # noqa: E402

from trainer.collate import collate_packed, collate_padded  # noqa: E402
from trainer.config import DataConfig, DistillConfig, ModelConfig  # noqa: E402
from trainer.data import load_dataset, load_tokenizer  # noqa: E402
from trainer.model.attention import resolve_backend  # noqa: E402
from trainer.model.wrapper import VarlenCausalLM  # noqa: E402
from trainer.objectives.distill.loss import student_terms  # noqa: E402
from trainer.objectives.distill.teacher import live_teacher  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)


def qwen2(vocab: int, tokenizer, hidden: int, layers: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=vocab,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )  # peaked distributions: divergences far from 0
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


@pytest.fixture(scope="module")
def peers(cache_dir):
    """Chat examples (loss on the replies) packed in one row and padded, a student and a teacher of other shapes."""
    tok = load_tokenizer(
        ModelConfig(chat_template="chatml", tokenizer_vocab_size=512),
        DataConfig(source="chat_synthetic", num_records=100, cache_dir=cache_dir),
    )
    data = load_dataset(DataConfig(source="chat_synthetic", num_records=100, cache_dir=cache_dir), tok, 512)
    picked = np.argsort(data.lengths)[[0, 20, 50, 80, 99]]  # lengths spread, the longest included
    student, teacher = qwen2(len(tok), tok, 32, 2, seed=0), qwen2(len(tok), tok, 48, 3, seed=1).eval()
    backend = resolve_backend("sdpa_varlen", torch.device("cpu"), torch.float32)
    ours = VarlenCausalLM(copy.deepcopy(student), backend)
    ours_teacher = VarlenCausalLM(copy.deepcopy(teacher), backend).requires_grad_(False)
    for m in (ours, ours_teacher):
        m.use_loss("chunked", chunk_tokens=7)  # several chunks of both heads
    packed, padded = collate_packed(data, picked), collate_padded(data, picked, tok.pad_token_id)
    assert packed.input_ids.shape[0] == 1 and padded.input_ids.shape[0] == len(picked)
    assert packed.num_label_tokens == padded.num_label_tokens < 0.8 * packed.num_tokens  # prompts carry no label
    return student, teacher.requires_grad_(False), ours, ours_teacher, packed, padded


def trl_loss_and_grads(student, teacher, padded, beta: float, temperature: float):
    student.train()
    student.zero_grad(set_to_none=True)
    inputs = {"input_ids": padded.input_ids, "attention_mask": padded.attention_mask, "labels": padded.labels}
    if temperature == 1.0:  # the trainer's own compute_loss (it passes no temperature)
        trainer = SimpleNamespace(
            teacher_model=teacher, beta=beta, generalized_jsd_loss=GKDTrainer.generalized_jsd_loss
        )
        loss = GKDTrainer.compute_loss(trainer, student, inputs)
    else:
        with torch.no_grad():
            teacher_logits = teacher(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits
        logits = student(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits
        loss = GKDTrainer.generalized_jsd_loss(
            logits[:, :-1], teacher_logits[:, :-1], padded.labels[:, 1:], beta=beta, temperature=temperature
        )
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in student.named_parameters()}


CASES = [  # (packfsdp divergence, its beta, TRL's beta, temperature)
    ("forward_kl", 0.5, 0.0, 1.0),
    ("reverse_kl", 0.5, 1.0, 1.0),
    ("jsd", 0.5, 0.5, 1.0),
    ("jsd", 0.2, 0.2, 2.0),
    ("forward_kl", 0.5, 0.0, 0.7),
]


@pytest.mark.parametrize(
    "divergence,beta,trl_beta,temperature", CASES, ids=[f"{c[0]}-beta{c[2]}-T{c[3]}" for c in CASES]
)
def test_packed_distillation_equals_trl_gkd_loss(peers, divergence, beta, trl_beta, temperature):
    student, teacher, ours, ours_teacher, packed, padded = peers
    trl_loss, trl_grads = trl_loss_and_grads(student, teacher, padded, trl_beta, temperature)

    cfg = DistillConfig(divergence=divergence, beta=beta, temperature=temperature, alpha=0.0)
    ours.train()
    ours.zero_grad(set_to_none=True)
    terms = student_terms(ours, packed, live_teacher(ours_teacher, packed, temperature), cfg)
    loss = terms[0] / packed.num_label_tokens
    loss.backward()
    grads = {n: p.grad for n, p in ours.model.named_parameters()}

    assert float(trl_loss) > 1e-3  # two different models: not the trivial 0
    torch.testing.assert_close(loss.detach(), trl_loss.float(), **TOL)
    assert grads.keys() == trl_grads.keys() and len(grads) > 5
    for name in grads:
        torch.testing.assert_close(grads[name], trl_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
