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
from trainer.collate import IGNORE_INDEX
from trainer.config import ParallelConfig
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
        torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {step}: {m}")
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {step} grads: {m}")
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
