"""``model.attention=flash_attn`` and ``torch_varlen`` end to end on CPU, through doubles of their kernels.

The flash-attn double (tests/gpu_sim/flash_attn_double.py, whose docstring lists what it checks) stands in
for the flash-attn 2.8.3 extension; tests/gpu_sim/torch_varlen_double.py gives torch's flash ops CPU
kernels with the same checks, so torch's own ``varlen_attn`` Python runs. The ``simulated_gpu`` fixture
installs both and patches only the device predicates (``backends_cuda._needs_cuda`` / ``_needs_sm80``,
torch's flash-availability flag), so ``resolve_backend`` and the backends run unchanged. Checked here:
the double keeps the kernel's contract and agrees with a float64 reference; every model family is packed
== one by one with fp32 master weights under bf16 autocast (3e-2, as bf16 allows) and exactly at fp32
(the doubles' ``accept_fp32``: the plumbing alone); the startup self-check passes under autocast. Only a
real GPU shows speed, memory, the kernel's own rounding and NCCL: the GPU-marked tests are for that.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu_sim import flash_attn_double
from tests.unit.test_attention_backends import call, qkv, reference
from tests.unit.test_model_families import FAMILIES, LENGTHS, assert_equivalent, examples, tiny_model
from trainer.collate import Batch
from trainer.data.examples import IGNORE_INDEX
from trainer.model import backends_cuda
from trainer.model.attention import BACKENDS, AttentionBackendError, resolve_backend
from trainer.model.certification import check_model

BF16 = torch.bfloat16
CPU = torch.device("cpu")
KERNEL_BACKENDS = ["flash_attn", "torch_varlen"]


def kernel_args(total=12, heads=4, kv_heads=2, dim=8, dtype=BF16):
    """Valid ``varlen_fwd`` arguments (two examples of 5 and 7 tokens), as a dict a test can spoil."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, 5, total], dtype=torch.int32)
    return dict(
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=7,
        max_seqlen_k=7,
        dropout_p=0.0,
        softmax_scale=0.35,
        causal=True,
    )


SPOILED = {
    "fp32": (lambda a: a | {x: a[x].float() for x in "qkv"}, "only support fp16 and bf16"),
    "mixed dtypes": (lambda a: a | {"v": a["v"].half()}, "query and value must have the same dtype"),
    "int64 cu_seqlens": (
        lambda a: a | {"cu_seqlens_q": a["cu_seqlens_q"].long()},
        "cu_seqlens_q must have dtype int32",
    ),
    "cu_seqlens elsewhere": (lambda a: a | {"cu_seqlens_k": a["cu_seqlens_k"].to("meta")}, "cu_seqlens_k must be on"),
    "strided last dim": (lambda a: a | {"k": a["k"].repeat(1, 1, 2)[..., ::2]}, "contiguous last dimension"),
    "strided cu_seqlens": (
        lambda a: a | {"cu_seqlens_q": torch.tensor([0, 0, 5, 0, 12, 0], dtype=torch.int32)[::2]},
        "must be contiguous",
    ),
    "head_dim 12": (
        lambda a: (b := kernel_args(dim=16)) | {x: b[x][..., :12].contiguous() for x in "qkv"},
        "head_size that is a multiple of 8",
    ),
    "head_dim 264": (lambda a: kernel_args(dim=264), "head dimension at most 256"),
    "heads 4 over 3": (lambda a: kernel_args(heads=4, kv_heads=3), "must divide number of heads in query"),
    "softcap with dropout": (lambda a: a | {"softcap": 30.0, "dropout_p": 0.1}, "Softcapping does not support dropout"),
    "max_seqlen too short": (lambda a: a | {"max_seqlen_q": 6}, "below the longest sequence"),
}


def test_the_double_accepts_valid_arguments():
    out = flash_attn_double.varlen_fwd(**kernel_args())
    assert out.shape == (12, 4, 8) and out.dtype == BF16


@pytest.mark.parametrize("case", list(SPOILED))
def test_the_double_refuses_what_the_kernel_refuses(case):
    spoil, message = SPOILED[case]
    with pytest.raises(RuntimeError, match=message):
        flash_attn_double.varlen_fwd(**spoil(kernel_args()))


def test_max_seqlen_must_be_a_python_int():
    a = kernel_args()
    with pytest.raises(TypeError, match="max_seqlen_q to be an int"):
        flash_attn_double.flash_attn_varlen_func(
            a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], torch.tensor(7), 7, causal=True
        )


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dim", [8, 12])  # 12: the wrapper pads to 16 and cuts the output back
def test_the_double_matches_the_reference(kv_heads, window, dim):
    lengths = [7, 1, 30, 12]
    q, k, v = qkv(lengths, kv_heads=kv_heads, dim=dim)

    def flat(x):
        return x.detach()[0].transpose(0, 1).to(BF16).requires_grad_()

    fq, fk, fv = flat(q), flat(k), flat(v)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    window_size = (-1, 0) if window is None else (window - 1, 0)
    out = flash_attn_double.flash_attn_varlen_func(
        fq, fk, fv, cu, cu, max(lengths), max(lengths), softmax_scale=0.3, causal=True, window_size=window_size
    )
    assert out.dtype == BF16 and out.shape == fq.shape
    expected = reference(
        fq[None].transpose(1, 2), fk[None].transpose(1, 2), fv[None].transpose(1, 2), lengths, window, 0.3
    )
    torch.testing.assert_close(out[None].double(), expected, atol=2e-2, rtol=2e-2)
    out.float().square().sum().backward()  # autograd runs through the double: backward works
    assert fq.grad.dtype == BF16 and fk.grad.shape == fk.shape and torch.isfinite(fv.grad.float()).all()


def test_softcap_caps_the_scores():
    a = kernel_args()
    capped = flash_attn_double.varlen_fwd(**a, softcap=0.01)
    # Scores within +-0.01: attention is uniform over the visible keys, unlike the uncapped result.
    assert not torch.allclose(capped, flash_attn_double.varlen_fwd(**a), atol=1e-2)
    first_two = a["v"][:2].float().repeat_interleave(2, dim=1).mean(0)
    torch.testing.assert_close(capped[1].float(), first_two, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------- the backend, through the double
def test_resolution_sees_a_capable_device(simulated_gpu):
    assert resolve_backend("flash_attn", CPU, BF16).name == "flash_attn"
    assert resolve_backend("torch_varlen", CPU, BF16).name == "torch_varlen"
    assert resolve_backend("auto", CPU, BF16).name == "flash_attn"
    with pytest.raises(AttentionBackendError, match="bfloat16/float16 only"):
        resolve_backend("flash_attn", CPU, torch.float32)  # the product's own dtype rule still holds


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_mixed_dtypes_under_autocast_reach_the_kernel_as_one(backend, simulated_gpu):
    """Defect 2 at the function level: rotary leaves q/k fp32 while v is bf16 under autocast."""
    lengths = [7, 1, 30, 12]
    q, k, v = qkv(lengths, kv_heads=2)
    with torch.autocast("cpu", dtype=BF16):
        out = call(BACKENDS[backend].fn, q, k, v.to(BF16), lengths, window=5)
    assert out.dtype == BF16
    torch.testing.assert_close(out.double(), reference(q, k, v, lengths, 5, 0.3), atol=3e-2, rtol=3e-2)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_gets_one_dtype_under_autocast(monkeypatch):
    """flex: its backward (and Inductor's lowering) refuses mixed q/k/v dtypes; the backend casts first."""
    seen = []

    def flex_spy(q, k, v, **kwargs):
        seen.append({q.dtype, k.dtype, v.dtype})
        return torch.nn.attention.flex_attention.flex_attention(q, k, v, **kwargs)

    monkeypatch.setattr(backends_cuda, "_flex_fn", lambda device: flex_spy)
    lengths = [7, 1, 30, 12]
    q, k, v = (x.detach() for x in qkv(lengths, kv_heads=2, dim=16))  # flex has no CPU backward
    with torch.autocast("cpu", dtype=BF16):
        out = call(backends_cuda.flex_attention_backend, q, k, v.to(BF16), lengths)
    assert seen == [{BF16}] and out.dtype == BF16


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_equals_one_by_one_bf16_autocast(family, backend, simulated_gpu):
    """fp32 master weights, bf16 compute (as FSDP's mixed precision runs it): logits and gradients."""
    model = tiny_model(family, "sdpa_varlen")
    model.backend = resolve_backend(backend, CPU, BF16)  # as the trainer resolves it: the compute dtype
    with torch.autocast("cpu", dtype=BF16):
        assert_equivalent(model, examples(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_equals_one_by_one_fp32_plumbing(family, backend, simulated_gpu_fp32):
    """At fp32 the double is exact, so any difference is the backend's plumbing (windows, GQA, layout)."""
    model = tiny_model(family, "sdpa_varlen")
    model.backend = BACKENDS[backend]  # resolve_backend rightly refuses fp32 for the real kernels
    assert_equivalent(model, examples(), atol=1e-5, rtol=1e-5)


def packed_batch(exs: list[torch.Tensor]) -> Batch:
    """The collated packed batch of ``exs`` (first token of each without a label)."""
    labels = [torch.cat([torch.tensor([IGNORE_INDEX]), e[1:]]) for e in exs]
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    n = int(cu[-1])
    return Batch(
        torch.cat(exs)[None],
        torch.cat(labels)[None],
        torch.cat([torch.arange(len(e)) for e in exs])[None],
        cu,
        max(LENGTHS),
        None,
        len(exs),
        n,
        n - len(exs),
        n,
    )


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_startup_self_check_under_autocast(family, backend, simulated_gpu):
    """qwen_chat_sft with a kernel backend: fp32 master weights, the check runs under bf16 autocast, passes."""
    model = tiny_model(family, "sdpa_varlen")
    model.backend = resolve_backend(backend, CPU, BF16)
    check_model(model, packed_batch(examples()), None, BF16)
