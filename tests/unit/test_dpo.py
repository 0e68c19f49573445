"""The preference objective (``trainer.objectives.dpo``): packed pairs == each sequence run alone.

Per-sequence summed reply log-probs, the DPO loss and every gradient of a packed pair batch equal those of
each sequence run alone through the plain transformers model (no packing, no chunked head), with the loss
written out here from the paper's formula, at fp32 1e-5: GPT-2 and a Qwen2 (GQA, sliding window), full
fine-tuning and LoRA (whose reference is the base with the adapters off); the padded baseline too.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.unit.test_lora import with_lora
from tests.unit.test_model_families import VOCAB, tiny_model
from trainer.collate import collate_packed, collate_padded
from trainer.config import DPOConfig
from trainer.data.examples import from_examples
from trainer.data.pairs import join_pair
from trainer.objectives.dpo import PairLoss, pair_losses, sequence_logps
from trainer.objectives.reference import LiveReference, adapters_off

PAIRS = [(5, 9, 3), (1, 14, 6), (7, 2, 11), (3, 8, 8), (10, 4, 1)]
"""(prompt, chosen, rejected) lengths: long and short replies, a one-token prompt, a one-token reply."""


def pair_dataset(shapes=PAIRS, seed: int = 3):
    """In-memory pairs of random tokens, labels on the replies (``join_pair``, as the renderer stores them)."""
    g = np.random.default_rng(seed)
    examples, splits = [], []
    for p, c, r in shapes:
        prompt = g.integers(0, VOCAB, p).tolist()

        def side(n, prompt=prompt):
            return prompt + g.integers(0, VOCAB, n).tolist(), [False] * len(prompt) + [True] * n

        ids, mask, split = join_pair(side(c), side(r))
        examples.append((ids, mask))
        splits.append(split)
    ds = from_examples(examples)
    ds.stored_pair_splits = np.array(splits, dtype=np.int64)
    return ds


class FixedReference:
    """Reference log-probs given per pair (as ``precompute`` stores them)."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values

    def logps(self, batch):
        return self.values


def alone_logps(model, ds, i: int) -> torch.Tensor:
    """[chosen, rejected] summed reply log-probs of pair ``i``, each sequence run alone (transformers' own
    SDPA on one unpadded row), from full logits."""
    out = []
    for ids, mask in ds.pair(i):
        ids, mask = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask)
        row = ids[None]
        logits = model(input_ids=row, position_ids=torch.arange(len(ids))[None], attention_mask=torch.ones_like(row))[
            0
        ].float()
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None]).squeeze(1)
        out.append((logp * mask[1:]).sum())
    return torch.stack(out)


def dpo_by_hand(policy: torch.Tensor, ref: torch.Tensor, beta: float) -> torch.Tensor:
    """Rafailov et al.'s loss, mean over pairs: -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))."""
    h = beta * ((policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1]))
    return -F.logsigmoid(h).mean()


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_packed_pairs_equal_each_sequence_alone(family, lora):
    model = tiny_model(family, "sdpa_varlen")
    model.use_loss("chunked", chunk_tokens=7)  # several chunks per batch
    if lora:
        model = with_lora(model)
    ds, cfg = pair_dataset(), DPOConfig(beta=0.5)
    indices = np.arange(len(PAIRS))
    g = torch.Generator().manual_seed(0)
    fixed = torch.randn(2 * len(PAIRS), generator=g, dtype=torch.float64) - 20.0
    reference = LiveReference(model, lora_base=True) if lora else FixedReference(fixed)

    batch = collate_packed(ds, indices)
    assert batch.num_pairs == len(PAIRS) and batch.num_examples == 2 * len(PAIRS)
    model.train()
    loss_sum, sums = PairLoss(cfg, reference).loss_sum(model, batch)
    (loss_sum / batch.num_pairs).backward()
    packed_grads = grads(model)
    packed_logps = sequence_logps(model, batch).detach().view(-1, 2)

    alone = torch.stack([alone_logps(model, ds, i) for i in indices])
    if lora:
        with torch.no_grad(), adapters_off(model):
            ref = torch.stack([alone_logps(model, ds, i) for i in indices]).double()
    else:
        ref = fixed.view(-1, 2)
    loss = dpo_by_hand(alone, ref.float(), cfg.beta)
    loss.backward()
    alone_grads = grads(model)

    torch.testing.assert_close(packed_logps, alone.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss_sum.detach() / batch.num_pairs, loss.detach(), atol=1e-5, rtol=1e-5)
    assert packed_grads.keys() == alone_grads.keys() and packed_grads
    for name in packed_grads:
        torch.testing.assert_close(
            packed_grads[name], alone_grads[name], atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
        assert packed_grads[name].abs().sum() > 0 or "wpe" in name, name
    assert sums[3] >= 0 and abs(float(sums[0]) - float(loss_sum.detach())) < 1e-6  # the metric sums carry the same loss


def test_padded_pairs_equal_packed_pairs():
    """``packing=none`` runs DPO padded (one row per sequence): the same loss and gradients as packed."""
    model = tiny_model("qwen2", "sdpa_varlen")
    model.use_loss("chunked")
    ds, objective = pair_dataset(), PairLoss(DPOConfig(), FixedReference(torch.zeros(2 * len(PAIRS))))
    results = []
    for collate in (collate_packed, collate_padded):
        batch = collate(ds, np.arange(len(PAIRS)), 0)
        loss_sum, _ = objective.loss_sum(model, batch)
        loss_sum.backward()
        results.append((loss_sum.detach(), grads(model)))
    (packed, g_packed), (padded, g_padded) = results
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    for name in g_packed:
        torch.testing.assert_close(g_packed[name], g_padded[name], atol=1e-5, rtol=1e-5)


def test_naive_head_gives_the_chunked_heads_logps():
    model, ds = tiny_model("gpt2", "sdpa_varlen"), pair_dataset()
    batch = collate_packed(ds, np.arange(len(PAIRS)))
    model.use_loss("naive")
    naive = sequence_logps(model, batch)
    model.use_loss("chunked", chunk_tokens=5)
    torch.testing.assert_close(sequence_logps(model, batch), naive, atol=1e-5, rtol=1e-5)


def test_loss_variants_follow_their_formulas():
    g = torch.Generator().manual_seed(2)
    pc, pr, rc, rr = (torch.randn(6, generator=g, dtype=torch.float64) * 3 - 30 for _ in range(4))
    lc, lr = (
        torch.tensor([3.0, 5, 1, 9, 2, 4], dtype=torch.float64),
        torch.tensor([7.0, 1, 2, 3, 8, 6], dtype=torch.float64),
    )
    beta, eps, gamma = 0.2, 0.1, 0.4
    h = beta * ((pc - rc) - (pr - rr))
    cdpo = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
    torch.testing.assert_close(pair_losses(pc, pr, rc, rr, DPOConfig(beta=beta, label_smoothing=eps))[0], cdpo)
    ipo = (((pc / lc - rc / lc) - (pr / lr - rr / lr)) - 1 / (2 * beta)) ** 2
    torch.testing.assert_close(pair_losses(pc, pr, rc, rr, DPOConfig(beta=beta, loss="ipo"), lc, lr)[0], ipo)
    simpo = -F.logsigmoid(beta * pc / lc - beta * pr / lr - gamma)
    losses, chosen, rejected = pair_losses(
        pc, pr, None, None, DPOConfig(beta=beta, loss="simpo", simpo_gamma=gamma), lc, lr
    )
    torch.testing.assert_close(losses, simpo)
    torch.testing.assert_close(chosen, beta * pc / lc)
    _, chosen, rejected = pair_losses(pc, pr, rc, rr, DPOConfig(beta=beta))
    torch.testing.assert_close(chosen - rejected, h)  # rewards: beta * (policy - reference)


def test_a_filler_batch_gives_zero_loss_and_zero_gradient():
    from trainer.collate import _empty_batch

    model = tiny_model("gpt2", "sdpa_varlen")
    model.use_loss("chunked")
    loss_sum, sums = PairLoss(DPOConfig(), FixedReference(None)).loss_sum(model, _empty_batch(0))
    loss_sum.backward()
    assert float(loss_sum) == 0.0 and not sums.any()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_precomputed_reference_is_the_live_one_stored_with_the_cache(tokenizer, tmp_path, monkeypatch):
    """``dpo.reference=precompute``: one pass stored next to the cache's arrays, keyed by the weights; the
    batches then carry what a live frozen copy computes, and a second run reads it instead of computing."""
    import dataclasses

    from trainer.config import DataConfig, ModelConfig
    from trainer.data import load_dataset
    from trainer.data.holdout import split_holdout
    from trainer.model import build_model, resolve_backend
    from trainer.objectives import reference as reference_module
    from trainer.objectives.reference import plan_reference

    data = load_dataset(
        DataConfig(source="preference_synthetic", num_records=40, cache_dir=str(tmp_path)), tokenizer, 512
    )
    train, held = split_holdout(data, 0.2, seed=1)
    model = build_model(
        ModelConfig(config_overrides=dict(n_layer=1, n_embd=16, n_head=2)),
        tokenizer,
        resolve_backend("sdpa_varlen", torch.device("cpu")),
        seed=7,
    )
    model.use_loss("chunked")
    live = plan_reference(DPOConfig(), model).build(model, lambda m: m, [], 0, torch.device("cpu"))
    plan = plan_reference(DPOConfig(reference="precompute"), model, "float32")
    stored = plan.build(model, None, [train, held], 512, torch.device("cpu"))
    assert (data.folder / f"ref_logps_{plan.fingerprint}.npy").is_file()
    for ds in (train, held):
        batch = collate_packed(ds, np.arange(min(4, len(ds))))
        torch.testing.assert_close(stored.logps(batch), live.logps(batch), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(reference_module, "sequence_logps", lambda *a: pytest.fail("computed again"))
    again = dataclasses.replace(train, stored_ref_logps=None)
    plan.build(model, None, [again], 512, torch.device("cpu"))
    np.testing.assert_array_equal(again.stored_ref_logps, train.stored_ref_logps)
    assert plan_reference(DPOConfig(reference="precompute"), model, "bfloat16").fingerprint != plan.fingerprint


def with_labels_shifted_into_the_next_sequence(monkeypatch):
    """A DPO-only defect: the per-sequence reduction of the log-probs puts each sequence's last label into the
    next sequence's sum (segments found one token late). The summed token loss never reduces per sequence,
    so SFT's loss, its logits and its gradient are untouched."""
    from trainer.model import wrapper

    real = wrapper.sequence_of_labels

    def late(labels, cu_seqlens):
        return real(labels, cu_seqlens - 1).clamp(max=len(cu_seqlens) - 2)

    monkeypatch.setattr(wrapper, "sequence_of_labels", late)


def test_self_check_checks_the_dpo_losss_gradient(monkeypatch):
    """The startup self-check under ``objective=dpo`` (``PairLossCheck``): a good packed (and padded) pair batch
    passes for every loss variant, with the reply log-probs compared per sequence; a wrong log-prob
    reduction fails it, although the SFT check (token loss) passes the same model; a gradient leak across
    the sequences of a pair that the logits cannot see fails it too."""
    from tests.unit.test_self_check import with_zero_init_leak
    from trainer.model import SelfCheckError, measure
    from trainer.model.certification import check_model
    from trainer.objectives.dpo import PairLossCheck

    model = tiny_model("gpt2", "sdpa_varlen")
    model.use_loss("chunked", chunk_tokens=7)
    ds = pair_dataset()
    batch = collate_packed(ds, np.arange(len(PAIRS)))
    padded = collate_padded(ds, np.arange(len(PAIRS)), 0)
    for cfg, b in (
        (DPOConfig(beta=0.5), batch),
        (DPOConfig(beta=0.5), padded),
        (DPOConfig(loss="ipo"), batch),
        (DPOConfig(loss="simpo", beta=2.0), batch),
    ):  # robust: sigmoid's path, another formula
        result = measure(model, b, loss=PairLossCheck(cfg))
        logp_diff = result.extra["max |sequence log-prob diff|"][0]
        assert result.ok and logp_diff < 1e-4 and result.grad_gap < 1e-5, result.line()
        assert f"dpo {cfg.loss} loss" in result.line() and "sequence log-prob diff" in result.line()

    check = PairLossCheck(DPOConfig(beta=0.5))
    with monkeypatch.context() as patched:
        with_labels_shifted_into_the_next_sequence(patched)
        assert measure(model, batch).ok  # the token loss is blind to it
        with pytest.raises(
            SelfCheckError, match=r"sequence log-prob diff\| \S+ \(tolerance .* over tolerance"
        ) as caught:
            check_model(model, batch, None, None, loss=check)
        broken = caught.value.args[0]
        logp, logp_tol, gap, gap_tol = map(
            float,
            re.search(
                r"log-prob diff\| (\S+) \(tolerance (\S+)\),.*gradient gap (\S+) "
                r"\(dpo sigmoid loss; tolerance (\S+?)[,;]",
                broken,
            ).groups(),
        )
        assert logp > logp_tol and gap > gap_tol, broken  # both the values and the gradient see it

    leaky = with_zero_init_leak(tiny_model("gpt2", "sdpa_varlen"))
    leaky.use_loss("chunked")
    result = measure(leaky, batch, loss=check)
    assert result.logit_diff <= result.logit_tolerance and result.grad_gap > result.grad_tolerance, result.line()
