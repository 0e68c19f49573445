"""``parallel.compile=true`` over varying packs: no recompiles after warm-up, compiled == eager (issue 12, defect 4).

``trainer.parallel.apply_compile`` compiles each decoder block's forward with dynamic shapes. Packed batches
differ from one another in token count, number of examples and their lengths; none of that may recompile a
block, or a run hits dynamo's recompile limit within a few steps and falls back to eager. The kernel
backends run here through the doubles of tests/gpu_sim (flash-attn's kernel and torch's ``varlen_attn`` are
custom ops with fake implementations, opaque to dynamo as on a GPU); ``sdpa_varlen`` is deliberately opaque
to dynamo (``torch.compiler.disable``: it loops over the examples in Python), so its blocks break the graph
at attention and must not recompile either.

Each case trains a tiny Qwen2 (GQA, a sliding-window layer and a full one: two graphs per block) for
``STEPS`` packs, counts the graphs dynamo compiles after ``WARMUP`` packs (and what ``TORCH_LOGS=recompiles``
would print) and compares every loss and gradient with an eager copy. The kernel backends compile with
``aot_eager`` (dynamo, then AOT autograd over the kernels' fake implementations, as Inductor sees them,
without code generation); ``sdpa_varlen`` with ``eager`` (dynamo alone decides recompiles; its attention is
not traced anyway, and ``tests/distributed/test_parallelize.py`` runs it under ``aot_eager``).

``objective=dpo`` (issue 27) adds no-grad passes through compiled blocks (the frozen reference, the policy's
eval): one graph each per grad mode, made in the first pack, and the same log-probs, loss and gradients.
"""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from tests.unit.test_model_families import VOCAB, WINDOW, tiny_model
from trainer.config import ParallelConfig
from trainer.data.examples import IGNORE_INDEX
from trainer.model.attention import BACKENDS
from trainer.parallel import apply_compile

STEPS = 24
WARMUP = 2
FAMILY = "qwen2"


def packs(steps: int = STEPS) -> list[list[int]]:
    """Example lengths per pack: 1 to 7 examples of 2 to 20 tokens, so token counts, example counts and the
    longest example all change from pack to pack; some examples are longer than the window."""
    rng = random.Random(0)
    return [[rng.randint(2, 20) for _ in range(rng.randint(1, 7))] for _ in range(steps)]


def train_step(model, lengths: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss of one packed batch and the gradients it gives (as the trainer feeds it: Python-int max_seqlen)."""
    g = torch.Generator().manual_seed(sum(lengths))
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=g)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, cu[:-1].long()] = IGNORE_INDEX  # no label across a boundary
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=pos, cu_seqlens=cu, max_seqlen=max(lengths))
    loss = F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes: threads cost more than they save, and compile time is single-threaded anyway."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def recompile_log(caplog):
    """dynamo's ``recompiles`` log (what ``TORCH_LOGS=recompiles`` prints), captured."""
    torch._logging.set_logs(recompiles=True)
    caplog.set_level(logging.DEBUG, logger="torch._dynamo.guards.__recompiles")
    try:
        yield caplog
    finally:
        torch._logging.set_logs()


def assert_no_recompiles(backend: str, compile_backend: str, recompile_log, steps: int = STEPS) -> None:
    torch._dynamo.reset()
    eager = tiny_model(FAMILY, "sdpa_varlen")
    eager.backend = BACKENDS[backend]  # fp32: the doubles are exact there (resolve_backend refuses fp32)
    assert eager.config.sliding_window == WINDOW
    compiled = copy.deepcopy(eager)
    counter = CompileCounterWithBackend(compile_backend)
    apply_compile(compiled.decoder_layers(), ParallelConfig(compile=True, compile_backend=counter))
    graphs_after_warmup, reasons_after_warmup = 0, []
    for step, lengths in enumerate(packs(steps)):
        if step == WARMUP:
            graphs_after_warmup, reasons_after_warmup = counter.frame_count, len(recompile_log.records)
        loss, grads = train_step(compiled, lengths)
        expected_loss, expected_grads = train_step(eager, lengths)
        torch.testing.assert_close(
            loss, expected_loss, atol=1e-5, rtol=1e-5, msg=lambda m, step=step: f"step {step}: {m}"
        )
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(
                got, want, atol=1e-5, rtol=1e-5, msg=lambda m, step=step: f"step {step} grads: {m}"
            )
    assert counter.frame_count > 0, "nothing was compiled"
    recompiles = [r.getMessage() for r in recompile_log.records[reasons_after_warmup:]]
    assert counter.frame_count == graphs_after_warmup and not recompiles, (
        f"{backend}: {counter.frame_count - graphs_after_warmup} graphs compiled after {WARMUP} warm-up packs; "
        f"recompiles: {recompiles[:3]}"
    )


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_kernel_backends_compile_once(backend, simulated_gpu_fp32, recompile_log):
    assert_no_recompiles(backend, "aot_eager", recompile_log)


def test_sdpa_varlen_blocks_compile_once(recompile_log):
    assert_no_recompiles("sdpa_varlen", "eager", recompile_log)


@pytest.mark.slow
def test_sdpa_varlen_blocks_compile_once_under_inductor(recompile_log):
    """The CPU path of ``parallel.compile=true`` as users run it: Inductor generates C++ for the block around
    the (opaque) attention. Still no recompile after warm-up, and compiled == eager. Fewer packs than the
    other cases: Inductor's code generation is the cost (~45 s of CPU), each pack adds little."""
    assert_no_recompiles("sdpa_varlen", "inductor", recompile_log, steps=8)


def dpo_step(
    policy, reference, pairs: list[tuple[int, int, int]]
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """``objective=dpo``'s work on one pack of (prompt, chosen, rejected) lengths, as the trainer runs it: the
    policy's per-sequence reply log-probs through the chunked head (with grad), the frozen reference's and the
    policy's eval pass (both no-grad). Returns (DPO loss, gradients, eval log-probs)."""
    from trainer.config import DPOConfig
    from trainer.objectives.dpo import pair_losses

    g = torch.Generator().manual_seed(sum(map(sum, pairs)))
    ids, labels, lengths = [], [], []
    for prompt, *replies in pairs:
        head = torch.randint(0, VOCAB, (prompt,), generator=g)
        for reply in replies:  # each sequence: the prompt, then its reply; loss on the reply only
            seq = torch.cat([head, torch.randint(0, VOCAB, (reply,), generator=g)])
            ids.append(seq)
            labels.append(torch.cat([torch.full((prompt,), IGNORE_INDEX), seq[prompt:]]))
            lengths.append(prompt + reply)
    batch = dict(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        cu_seqlens=torch.tensor([0, *lengths]).cumsum(0).to(torch.int32),
        max_seqlen=max(lengths),
        labels=torch.cat(labels)[None],
    )
    policy.zero_grad(set_to_none=True)
    logps = policy.sequence_logps(**batch)
    with torch.no_grad():
        ref = reference.sequence_logps(**batch)
    loss = pair_losses(logps[0::2], logps[1::2], ref[0::2], ref[1::2], DPOConfig())[0].sum()
    loss.backward()
    policy.eval()
    with torch.no_grad():
        evaluated = policy.sequence_logps(**batch)
    policy.train()
    return loss.detach(), [p.grad.clone() for p in policy.parameters()], evaluated


def test_dpo_compiles_once_per_grad_mode_and_equals_eager(recompile_log, monkeypatch):
    """``objective=dpo`` under ``parallel.compile=true``: the policy's blocks run with grad (training) and
    without (its eval), the frozen reference's compiled blocks without grad; each is a graph of its own
    (dynamo guards grad mode and ``requires_grad``), made in the first pack, none after, within dynamo's
    recompile limit; losses, gradients and eval log-probs equal eager's. The chunked head sits in the root's
    forward, outside the compiled blocks."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)  # never a silent eager fallback
    eager = tiny_model(FAMILY, "sdpa_varlen")
    eager.use_loss("chunked")
    eager_ref = copy.deepcopy(eager).requires_grad_(False).eval()
    with torch.no_grad():  # a reference apart from the policy, so the loss is not log 2 everywhere
        for p in eager_ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    compiled, compiled_ref = copy.deepcopy(eager), copy.deepcopy(eager_ref)
    counter = CompileCounterWithBackend("eager")
    for model in (compiled, compiled_ref):
        apply_compile(model.decoder_layers(), ParallelConfig(compile=True, compile_backend=counter))
    rng = random.Random(1)
    packs = [
        [(rng.randint(1, 6), rng.randint(1, 9), rng.randint(1, 9)) for _ in range(rng.randint(1, 3))] for _ in range(4)
    ]
    for step, pairs in enumerate(packs):
        if step == 1:
            graphs_after_warmup, reasons_after_warmup = counter.frame_count, len(recompile_log.records)
        got, want = dpo_step(compiled, compiled_ref, pairs), dpo_step(eager, eager_ref, pairs)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5, msg=lambda m, step=step: f"pack {step}: {m}")
        torch.testing.assert_close(
            got[2], want[2], atol=1e-5, rtol=1e-5, msg=lambda m, step=step: f"pack {step} eval: {m}"
        )
        for g, w in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m, step=step: f"pack {step} grads: {m}")
    recompiles = [r.getMessage() for r in recompile_log.records[reasons_after_warmup:]]
    assert graphs_after_warmup > 0 and counter.frame_count == graphs_after_warmup and not recompiles, recompiles[:3]
