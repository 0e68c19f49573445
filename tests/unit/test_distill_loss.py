"""The chunked distillation loss equals the same loss from full logits: the sum and the gradients of the
student's hidden states, head weight and bias, fp32, every divergence, temperatures, alphas, a softcapped head,
several chunks; the top-k teacher with the whole vocabulary equals the live one, a smaller top-k equals the
coarsened distributions (k tokens and a rest bucket); eval (no grad) gives the same sums."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.config.distill import DistillConfig
from trainer.loss import LogitTransform
from trainer.objectives.distill.loss import HeadTeacher, TopKTeacher, chunked_distill_loss, naive_distill_loss

N, HIDDEN, TEACHER_HIDDEN, VOCAB = 23, 16, 24, 41


def problem(seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.5
    b = torch.randn(VOCAB, generator=g) * 0.1 if bias else None
    teacher_hidden = torch.randn(N, TEACHER_HIDDEN, generator=g)
    teacher_weight = torch.randn(VOCAB, TEACHER_HIDDEN, generator=g) * 0.5
    targets = torch.randint(0, VOCAB, (N,), generator=g)
    return hidden, weight, b, teacher_hidden, teacher_weight, targets


def reference(student_logits, teacher_logits, targets, cfg: DistillConfig) -> torch.Tensor:
    """The loss from full logits, written as TRL's ``generalized_jsd_loss`` writes it (``F.kl_div``), summed."""
    s = F.log_softmax(student_logits / cfg.temperature, -1)
    t = F.log_softmax(teacher_logits / cfg.temperature, -1)
    if cfg.divergence == "forward_kl":
        d = F.kl_div(s, t, reduction="none", log_target=True)
    elif cfg.divergence == "reverse_kl":
        d = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        beta = torch.tensor(cfg.beta)
        m = torch.logsumexp(torch.stack([s + torch.log1p(-beta), t + torch.log(beta)]), 0)
        d = cfg.beta * F.kl_div(m, t, reduction="none", log_target=True) + (1 - cfg.beta) * F.kl_div(
            m, s, reduction="none", log_target=True
        )
    if not cfg.alpha:  # (the coarsened test's student is no vocabulary to take a cross-entropy over)
        return d.sum()
    return cfg.alpha * F.cross_entropy(student_logits, targets, reduction="sum") + (1 - cfg.alpha) * d.sum()


CASES = [
    DistillConfig(divergence="forward_kl", alpha=0.0),
    DistillConfig(divergence="reverse_kl", alpha=0.0, temperature=2.0),
    DistillConfig(divergence="jsd", beta=0.3, alpha=0.5),
    DistillConfig(divergence="jsd", beta=0.9, alpha=0.25, temperature=0.5),
    DistillConfig(divergence="forward_kl", alpha=1.0),
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.divergence}-b{c.beta}-T{c.temperature}-a{c.alpha}")
@pytest.mark.parametrize(
    "transform", [LogitTransform(), LogitTransform(scale=0.7, softcap=3.0)], ids=["plain", "softcap"]
)
def test_chunked_equals_full_logits(cfg, transform):
    hidden, weight, bias, t_hidden, t_weight, targets = problem()
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    want = reference(
        transform.apply(F.linear(*leaves))[0], transform.apply(F.linear(t_hidden, t_weight))[0], targets, cfg
    )
    want_grads = torch.autograd.grad(want, leaves)

    teacher = HeadTeacher(t_hidden, t_weight, None, transform, cfg.temperature)
    ours = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    sums = chunked_distill_loss(*ours, targets, teacher, cfg, transform, chunk_tokens=5)  # 5 chunks, a short last
    grads = torch.autograd.grad(sums[0] * 0.5, ours)  # backward scales what forward computed

    torch.testing.assert_close(sums[0], want.detach(), rtol=1e-5, atol=1e-5)
    for ours_g, want_g in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(ours_g, want_g * 0.5, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # eval: the same sums, no gradient pass
        torch.testing.assert_close(
            chunked_distill_loss(hidden, weight, bias, targets, teacher, cfg, transform, 5), sums.detach()
        )
    # the parts: cross-entropy (temperature 1) and divergence, mixed by alpha
    ce = F.cross_entropy(transform.apply(F.linear(hidden, weight, bias))[0], targets, reduction="sum")
    torch.testing.assert_close(sums[1], ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums[0], cfg.alpha * sums[1] + (1 - cfg.alpha) * sums[2])


def topk_of(logits: torch.Tensor, k: int, temperature: float) -> TopKTeacher:
    logp = F.log_softmax(logits / temperature, -1)
    values, ids = logp.topk(k, dim=-1)
    rest = logp.scatter(1, ids, float("-inf")).logsumexp(-1)
    return TopKTeacher(ids, values, rest)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_topk_of_whole_vocabulary_equals_live(divergence):
    cfg = DistillConfig(divergence=divergence, alpha=0.3, temperature=1.5)
    hidden, weight, bias, t_hidden, t_weight, targets = problem(1)
    live = HeadTeacher(t_hidden, t_weight, None, LogitTransform(), cfg.temperature)
    topk = topk_of(F.linear(t_hidden, t_weight), VOCAB, cfg.temperature)  # an empty rest: the floor, no NaN
    results = []
    for teacher in (live, topk):
        leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
        sums = chunked_distill_loss(*leaves, targets, teacher, cfg, chunk_tokens=4)
        results.append((sums.detach(), torch.autograd.grad(sums[0], leaves)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(results[1][1], results[0][1], strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_topk_is_the_coarsened_distributions(divergence):
    """k tokens and a rest bucket: the divergence of the two coarsened distributions, written out."""
    cfg, k = DistillConfig(divergence=divergence, alpha=0.0, temperature=1.0), 6
    hidden, weight, bias, t_hidden, t_weight, targets = problem(2, bias=False)
    t_logits = F.linear(t_hidden, t_weight)
    ids = t_logits.topk(k, dim=-1).indices
    in_k = torch.zeros(N, VOCAB, dtype=torch.bool).scatter(1, ids, True)

    def coarse(logits):  # probabilities of the k ids (the teacher's order) and of the rest
        p = F.softmax(logits, -1)
        return torch.cat([p.gather(1, ids), (p * ~in_k).sum(-1, keepdim=True)], 1).log()

    leaves = [x.clone().requires_grad_() for x in (hidden, weight)]
    cs, ct = coarse(F.linear(*leaves)), coarse(t_logits)
    want = reference(cs, ct, targets, cfg)  # its log_softmax of log-probabilities changes nothing
    want_grads = torch.autograd.grad(want, leaves)

    ours = [x.clone().requires_grad_() for x in (hidden, weight)]
    sums = chunked_distill_loss(*ours, None, targets, topk_of(t_logits, k, 1.0), cfg, chunk_tokens=8)
    grads = torch.autograd.grad(sums[0], ours)
    torch.testing.assert_close(sums[0], want.detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_naive_equals_chunked():
    cfg = DistillConfig(divergence="jsd", beta=0.4, alpha=0.2, temperature=1.3)
    hidden, weight, bias, t_hidden, t_weight, targets = problem(3)
    teacher = HeadTeacher(t_hidden, t_weight, None, LogitTransform(), cfg.temperature)
    a = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    chunked = chunked_distill_loss(*a, targets, teacher, cfg, chunk_tokens=6)
    b = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    naive = naive_distill_loss(F.linear(*b), targets, teacher, cfg, chunk_tokens=6)
    torch.testing.assert_close(naive.detach(), chunked.detach())
    for ga, gb in zip(torch.autograd.grad(chunked[0], a), torch.autograd.grad(naive[0], b), strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)


def test_no_label_token_gives_zero():
    cfg = DistillConfig()
    hidden, weight, bias, t_hidden, t_weight, targets = problem()
    leaves = [
        x[:0].clone().requires_grad_() if i == 0 else x.clone().requires_grad_()
        for i, x in enumerate((hidden, weight, bias))
    ]
    teacher = HeadTeacher(t_hidden[:0], t_weight, None, LogitTransform(), 1.0)
    sums = chunked_distill_loss(*leaves, targets[:0], teacher, cfg)
    sums[0].backward()
    assert float(sums.detach().abs().sum()) == 0.0 and float(leaves[1].grad.abs().sum()) == 0.0
