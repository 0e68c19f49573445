"""packfsdp's packed DPO == TRL's ``DPOTrainer`` (an implementation no one here wrote), on the same weights,
pairs and tokenization: the loss and its gradient of one step, at fp32 1e-5. Runs when the ``peer`` extra
(trl==1.16.0) is installed; skipped otherwise.

The TRL code path compared, by name (trl 1.16.0, ``trl/trainer/dpo_trainer.py``): ``DPOTrainer.__init__``
tokenizes the rows (``_prepare_dataset``: plain strings with EOS appended, or chats through the tokenizer's
chat template), ``DataCollatorForPreference`` pads the batch ([chosen rows; rejected rows], completion mask),
``DPOTrainer.compute_loss`` -> ``_compute_loss`` runs the policy through TRL's fused LM head
(``add_fused_lm_head``: per-token log-probs, no full logits), the live ``ref_model`` under no_grad, and the
loss types ``sigmoid``, ``robust`` (with ``label_smoothing``) and ``ipo`` (on mean token log-probs), mean over
pairs. cDPO (packfsdp's ``sigmoid`` with ``label_smoothing``) is no TRL 1.16 loss type by that name: TRL's
``aot`` on one-pair batches is it (sorting one pair's log-ratio is the identity), so that case calls
``compute_loss`` once per pair and averages.

packfsdp's side: TRL's token ids as pre-tokenized pairs (``prompt_input_ids`` / ``chosen_input_ids`` /
``rejected_input_ids``) through packfsdp's data route, all pairs in one packed row (``collate_packed``),
``PairLoss`` (``trainer.objectives.dpo``) with a ``LiveReference`` through the chunked head, divided by the pair count.
The reference is a perturbed copy of the policy, so the loss is not trivially log 2. The reference-free
``simpo`` is compared with TRL's SimPO (``trl.experimental.cpo.CPOTrainer``) the same way (last test).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl", reason="the peer extra is not installed (pip install -e .[peer])")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from trainer.collate import collate_packed  # noqa: E402
from trainer.config import DataConfig, DPOConfig, ModelConfig  # noqa: E402
from trainer.data import load_dataset, load_tokenizer  # noqa: E402
from trainer.model.attention import resolve_backend  # noqa: E402
from trainer.model.wrapper import VarlenCausalLM  # noqa: E402
from trainer.objectives.dpo import PairLoss  # noqa: E402
from trainer.objectives.reference import LiveReference  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
WORDS = "the a train bus shop opens closes at nine ten today tomorrow early late please thanks sorry yes no".split()


def sentence(g: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[k] for k in g.integers(0, len(WORDS), n)) + "."


def string_pairs(g, n=6) -> list[dict]:
    """Plain-string pairs, reply lengths spread (one a single word), replies starting with a space as TRL's
    docs write them (the prompt then ends on a token boundary)."""
    return [
        {
            "prompt": "Q: " + sentence(g, int(g.integers(2, 9))),
            "chosen": " " + sentence(g, int(g.integers(1, 15))),
            "rejected": " " + sentence(g, int(g.integers(1, 12))),
        }
        for _ in range(n)
    ]


def chat_pairs(g, n=6) -> list[dict]:
    """TRL's conversational format: the prompt a list of turns (a multi-turn one first), replies one message."""
    rows = []
    for k in range(n):
        prompt = [{"role": "user", "content": sentence(g, int(g.integers(2, 8)))}]
        if k == 0:
            prompt += [{"role": "assistant", "content": sentence(g, 3)}, {"role": "user", "content": sentence(g, 4)}]

        def reply():
            return [{"role": "assistant", "content": sentence(g, int(g.integers(1, 14)))}]

        rows.append({"prompt": prompt, "chosen": reply(), "rejected": reply()})
    return rows


def tiny(family: str, vocab: int, tokenizer) -> torch.nn.Module:
    torch.manual_seed(0)
    sizes = (
        dict(n_layer=2, n_embd=32, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        if family == "gpt2"
        else dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
    )
    config = AutoConfig.for_model(
        family, vocab_size=vocab, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **sizes
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def perturbed(model: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return ref.requires_grad_(False).eval()


def trl_trainer(model, ref, tokenizer, rows, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer

    args = TRLConfig(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=len(rows),
        max_length=None,
        disable_dropout=True,
        save_strategy="no",
        dataloader_num_workers=0,
    )
    return DPOTrainer(
        model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )


def trl_loss_and_grads(trainer, loss: str, eps: float, beta: float):
    """TRL's one-step loss (its collator, ``compute_loss``) and the policy's gradients. One trainer serves
    every case: ``_compute_loss`` reads the loss settings from the attributes ``__init__`` sets from
    ``DPOConfig`` (``beta``, ``loss_types``, ``loss_weights``, ``label_smoothing``), set here the same way."""
    trainer.beta, trainer.loss_types, trainer.loss_weights, trainer.label_smoothing = beta, [loss], [1.0], eps
    examples = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    model = trainer.model.train()
    model.zero_grad(set_to_none=True)
    batches = [examples] if loss != "aot" else [[e] for e in examples]  # aot: one pair per batch (cDPO)
    total = 0.0
    for batch in batches:
        value = trainer.compute_loss(model, trainer.data_collator(batch)) / len(batches)
        value.backward()
        total += value.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def packfsdp_batch(examples, tokenizer, tmp_path):
    """The same token ids as pre-tokenized pairs through packfsdp's data route, packed into one row."""
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "prompt_input_ids": e["prompt_ids"],
                    "chosen_input_ids": e["chosen_ids"],
                    "rejected_input_ids": e["rejected_ids"],
                }
            )
            + "\n"
            for e in examples
        )
    )
    ds = load_dataset(DataConfig(source="jsonl", path=str(path), cache_dir=str(tmp_path / "cache")), tokenizer, 4096)
    assert ds.is_pairs and len(ds) == len(examples)
    batch = collate_packed(ds, np.arange(len(ds)))
    assert batch.num_pairs == len(examples) and batch.input_ids.shape[0] == 1  # one packed row, every pair
    return batch


def packfsdp_loss_and_grads(policy, reference, batch, cfg: DPOConfig):
    policy.train()
    policy.zero_grad(set_to_none=True)
    loss_sum, _ = PairLoss(cfg, LiveReference(reference)).loss_sum(policy, batch)
    loss = loss_sum / batch.num_pairs
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


CASES = [  # (packfsdp dpo.loss, TRL loss_type, label_smoothing, beta)
    ("sigmoid", "sigmoid", 0.0, 0.5),
    ("sigmoid", "aot", 0.2, 0.5),  # cDPO
    ("robust", "robust", 0.2, 0.5),
    ("ipo", "ipo", 0.0, 0.3),
]


@pytest.fixture(scope="module", params=["gpt2", "qwen2"])
def peers(request, tokenizer, cache_dir, tmp_path_factory):
    """One family's two sides on the same weights: GPT-2 on plain-string pairs (the DailyDialog BPE), a
    Qwen2 (GQA) on chat pairs (a multi-turn prompt; ChatML template); TRL's trainer, packfsdp's models."""
    family, tmp_path = request.param, tmp_path_factory.mktemp(request.param)
    if family == "gpt2":
        tok, rows = copy.deepcopy(tokenizer), string_pairs(np.random.default_rng(0))
    else:
        tok = load_tokenizer(
            ModelConfig(chat_template="chatml", tokenizer_vocab_size=512),
            DataConfig(source="chat_synthetic", num_records=100, cache_dir=cache_dir),
        )
        rows = chat_pairs(np.random.default_rng(0))
    model = tiny(family, len(tok), tok)
    ref = perturbed(model)
    backend = resolve_backend("sdpa_varlen", torch.device("cpu"), torch.float32)
    policy, reference = VarlenCausalLM(copy.deepcopy(model), backend), VarlenCausalLM(copy.deepcopy(ref), backend)
    for m in (policy, reference):
        m.use_loss("chunked", chunk_tokens=7)  # several chunks: the fused head's chunking is exercised
    trainer = trl_trainer(model, ref, tok, rows, tmp_path)  # patches its own copies' forward (fused head)
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    assert all(e["chosen_ids"] and e["rejected_ids"] for e in examples)
    return trainer, policy, reference, packfsdp_batch(examples, tok, tmp_path)


@pytest.mark.parametrize("ours,theirs,eps,beta", CASES, ids=[f"{c[0]}-{c[1]}-eps{c[2]}" for c in CASES])
def test_packed_dpo_equals_trl_dpo_trainer(peers, ours, theirs, eps, beta):
    trainer, policy, reference, batch = peers
    trl_loss, trl_grads = trl_loss_and_grads(trainer, theirs, eps, beta)
    loss, grads = packfsdp_loss_and_grads(
        policy, reference, batch, DPOConfig(beta=beta, loss=ours, label_smoothing=eps)
    )

    assert abs(float(trl_loss) - np.log(2)) > 1e-3  # the perturbed reference: not the trivial log 2
    torch.testing.assert_close(loss, trl_loss.float(), **TOL)
    assert grads.keys() == trl_grads.keys() and len(grads) > 5
    for name in grads:
        torch.testing.assert_close(grads[name], trl_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_packed_simpo_equals_trl_cpo_trainer_simpo(tokenizer, tmp_path):
    """The reference-free ``simpo`` == TRL's SimPO (``trl.experimental.cpo.CPOTrainer``, ``loss_type="simpo"``,
    ``cpo_alpha=0``: no NLL term): its tokenization (``tokenize_row``: BOS + prompt, reply + EOS), its padded
    collator, ``compute_loss`` -> ``get_batch_loss_metrics`` (full logits, ``get_batch_logps`` averaged over
    the reply tokens) against the same ids packed; GPT-2, plain strings, fp32 1e-5."""
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    tok, rows = copy.deepcopy(tokenizer), string_pairs(np.random.default_rng(1))
    model = tiny("gpt2", len(tok), tok)
    backend = resolve_backend("sdpa_varlen", torch.device("cpu"), torch.float32)
    policy = VarlenCausalLM(copy.deepcopy(model), backend)
    policy.use_loss("chunked", chunk_tokens=7)
    beta, gamma = 2.0, 0.5
    args = CPOConfig(
        output_dir=str(tmp_path / "cpo"),
        report_to=[],
        use_cpu=True,
        bf16=False,
        loss_type="simpo",
        cpo_alpha=0.0,
        beta=beta,
        simpo_gamma=gamma,
        per_device_train_batch_size=len(rows),
        max_length=512,
        disable_dropout=True,
        save_strategy="no",
        dataloader_num_workers=0,
    )
    trainer = CPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    trl_model = trainer.model.train()
    trl_loss = trainer.compute_loss(trl_model, trainer.data_collator(examples))
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in trl_model.named_parameters() if p.grad is not None}

    def split(e, side):  # TRL's sequence = prompt (labels -100) + reply
        ids, labels = e[f"{side}_input_ids"], e[f"{side}_labels"]
        n = sum(label == -100 for label in labels)
        return ids[:n], ids[n:]

    pairs = []
    for e in examples:
        (prompt, chosen), (prompt_r, rejected) = split(e, "chosen"), split(e, "rejected")
        assert prompt == prompt_r
        pairs.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
    batch = packfsdp_batch(pairs, tok, tmp_path)
    policy.train()
    loss_sum, _ = PairLoss(DPOConfig(beta=beta, loss="simpo", simpo_gamma=gamma), None).loss_sum(policy, batch)
    loss = loss_sum / batch.num_pairs
    loss.backward()
    grads = {n: p.grad for n, p in policy.model.named_parameters() if p.grad is not None}

    torch.testing.assert_close(loss.detach(), trl_loss.detach().float(), **TOL)
    assert grads.keys() == trl_grads.keys() and len(grads) > 5
    for name in grads:
        torch.testing.assert_close(grads[name], trl_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
