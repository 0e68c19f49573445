"""Attention sinks (``s_aux``: gpt-oss, Granite SWA, MiMo-V2-Flash, ...) on every packed backend, exactly.

A sink is a learned logit per query head in every softmax's denominator (``trainer.model.sinks``). Each
backend is compared with a float64 per-example reference that applies the sink as transformers' eager
attention does (the sink as one more column of the scores, dropped after the softmax), on the output and
the gradients of q, k, v and the sinks, with GQA and a sliding window: the SDPA backends in float64,
``flash_attn`` / ``torch_varlen`` through the kernel doubles in fp32 (their lse has no gradient: the
backend's ``KernelLSE`` supplies it), ``flex`` through a dense double with a backward (its own CPU path
has none; its forward is also checked as torch runs it). Then models: a tiny gpt_oss packed vs alone in
float64 through an independent probe, the trainer's CLI on CPU, the families' eager variants.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.gpu_sim import flash_attn_double, flex_double, torch_varlen_double
from tests.gpu_sim.device import pretend_capable_gpu
from tests.unit.test_attention_backends import CAUSAL
from trainer.model import backends_cuda
from trainer.model.attention import BACKENDS, AttentionBackendError, AttentionNeeds, resolve_backend
from trainer.model.prepare import prepare_model

CUDA = torch.device("cuda")  # only named: the device predicates are patched
LENGTHS = [7, 1, 19, 12, 3]
"""Longer and shorter than the window, a 1-token example; several buckets and tiles on the SDPA paths."""
WINDOW = 5
SCALE = 0.3
GPT_OSS = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    sliding_window=WINDOW,
    num_local_experts=4,
    num_experts_per_tok=2,
    layer_types=["sliding_attention", "full_attention"],
    pad_token_id=0,
)


def sink_reference(q, k, v, sinks, lengths, window, scale):
    """Per-example attention with a sink column, float64: ``[1, H, T, D]`` -> ``[1, T, H, D]``."""
    q, k, v, sinks = (x.double() for x in (q, k, v, sinks))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    outs, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        scores = q[:, :, s] @ k[:, :, s].transpose(-1, -2) * scale
        i = torch.arange(n)
        ok = i[None, :] <= i[:, None]
        if window:
            ok &= i[:, None] - i[None, :] < window
        scores = torch.cat([scores.masked_fill(~ok, float("-inf")), sinks.view(1, -1, 1, 1).expand(1, -1, n, 1)], -1)
        outs.append(scores.softmax(-1)[..., :-1] @ v[:, :, s])
        start += n
    return torch.cat(outs, 2).transpose(1, 2)


def inputs(dtype, kv_heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(1, h, total, 8, generator=g, dtype=dtype).requires_grad_() for h in (4, kv_heads, kv_heads))
    sinks = (torch.randn(4, generator=g, dtype=dtype) * 2).requires_grad_()
    return q, k, v, sinks


def run(name, q, k, v, sinks, window):
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    out, _ = BACKENDS[name].fn(
        CAUSAL,
        q,
        k,
        v,
        None,
        scaling=SCALE,
        dropout=0.0,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max(LENGTHS),
        max_length_k=max(LENGTHS),
        sliding_window=window,
        s_aux=sinks,
    )
    return out


@pytest.fixture
def kernels(monkeypatch):
    """flash_attn / torch_varlen through their kernel doubles (fp32 accepted: the plumbing exactly), flex
    through a dense double with a backward."""
    flash_attn_double.install(monkeypatch, accept_fp32=True)
    flex_double.install(monkeypatch)
    pretend_capable_gpu(monkeypatch)
    with torch_varlen_double.registered():
        yield


CASES = [
    ("sdpa_varlen", torch.float64, 1e-10),
    ("sdpa_block_mask", torch.float64, 1e-10),
    ("flash_attn", torch.float32, 2e-5),
    ("torch_varlen", torch.float32, 2e-5),
    ("flex", torch.float64, 1e-10),
]


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("name,dtype,tol", CASES, ids=[c[0] for c in CASES])
def test_every_backend_applies_sinks_exactly_with_gradients(name, dtype, tol, kv_heads, window, kernels):
    q, k, v, sinks = inputs(dtype, kv_heads)
    out = run(name, q, k, v, sinks, window)
    ref = sink_reference(q, k, v, sinks, LENGTHS, window, SCALE)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    cotangent = torch.randn(
        ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype
    )  # not the global RNG's
    got = torch.autograd.grad(out, (q, k, v, sinks), cotangent.to(out.dtype))
    want = torch.autograd.grad(ref, (q, k, v, sinks), cotangent)
    for what, g, w in zip("q k v sinks".split(), got, want, strict=True):
        torch.testing.assert_close(
            g.double(), w.double(), atol=tol, rtol=tol, msg=lambda m, what=what: f"grad {what}: {m}"
        )
    assert got[3].abs().min() > 1e-3  # every head's sink is trained


def test_flash_attn_sinks_under_dropout(kernels, monkeypatch):
    """Attention dropout with sinks: the kernel's dropout output (the same draws as without sinks) times
    the sink's share from the lse of a call without dropout, which never asks for the probabilities."""
    from flash_attn import flash_attn_varlen_func

    asked = []

    def spy(*args, **kwargs):
        asked.append((kwargs.get("dropout_p", 0.0), kwargs.get("return_attn_probs", False)))
        return flash_attn_varlen_func(*args, **kwargs)

    monkeypatch.setattr("flash_attn.flash_attn_varlen_func", spy)
    q, k, v, sinks = (x.detach() for x in inputs(torch.float32))
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)

    def attention(**extra):
        torch.manual_seed(3)
        return BACKENDS["flash_attn"].fn(
            CAUSAL,
            q,
            k,
            v,
            None,
            scaling=SCALE,
            dropout=0.3,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=19,
            max_length_k=19,
            **extra,
        )[0]

    plain, with_sinks = attention(), attention(s_aux=sinks)
    assert (0.3, True) not in asked and (0.0, True) in asked
    # the sink's share of each query's softmax: the reference's output with values all 1 (GQA: 2 kv heads)
    share = sink_reference(q, k, torch.ones_like(v), sinks, LENGTHS, None, SCALE)
    torch.testing.assert_close(with_sinks.double(), plain.double() * share, atol=2e-5, rtol=2e-5)


def test_the_sink_check_sees_a_sink_dropped(kernels):
    """The reference is sensitive: the same attention without the sink is far from it."""
    q, k, v, sinks = inputs(torch.float64)
    ref = sink_reference(q, k, v, sinks, LENGTHS, WINDOW, SCALE)
    without = run("sdpa_varlen", q, k, v, None, WINDOW)
    assert (without.double() - ref).abs().max() > 0.1


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_as_torch_runs_it_on_cpu():
    q, k, v, sinks = (x.detach() for x in inputs(torch.float64))
    out = run("flex", q, k, v, sinks, WINDOW)
    torch.testing.assert_close(out, sink_reference(q, k, v, sinks, LENGTHS, WINDOW, SCALE), atol=1e-10, rtol=1e-10)


def test_the_kernels_lse_has_no_gradient_of_its_own(kernels):
    """What ``KernelLSE`` is for: flash-attn's lse comes back without a gradient path into q and k."""
    from flash_attn import flash_attn_varlen_func

    q, k, v, _ = inputs(torch.float32)
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    flat = [x[0].transpose(0, 1) for x in (q, k, v)]
    _, lse, _ = flash_attn_varlen_func(*flat, cu, cu, 19, 19, causal=True, return_attn_probs=True)
    assert lse.shape == (4, sum(LENGTHS)) and lse.dtype == torch.float32
    grads = torch.autograd.grad(lse.sum(), (q, k), allow_unused=True, materialize_grads=True)
    assert all(float(g.abs().max()) == 0.0 for g in grads)


# -------------------------------------------------------------------------------- refusals
def test_sinks_with_softcapping_are_refused(kernels):
    q, k, v, sinks = inputs(torch.float32)
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    for name in ("flash_attn", "flex"):
        with pytest.raises(AttentionBackendError, match="cannot combine attention sinks .* softcapping"):
            BACKENDS[name].fn(
                CAUSAL, q, k, v, None, scaling=SCALE, cu_seq_lens_q=cu, cu_seq_lens_k=cu, s_aux=sinks, softcap=30.0
            )


def test_a_torch_without_the_varlen_lse_refuses_sinks_at_start(kernels, monkeypatch):
    needs = AttentionNeeds.of(AutoConfig.for_model("gpt_oss"))
    assert resolve_backend("torch_varlen", CUDA, torch.bfloat16, needs).name == "torch_varlen"
    monkeypatch.setitem(backends_cuda._varlen_attn_signature, "names", frozenset({"query", "key", "value", "scale"}))
    with pytest.raises(
        AttentionBackendError,
        match=r"model.attention=torch_varlen cannot run here: it cannot honour "
        r"gpt_oss's attention sinks \(s_aux\): torch .*'s varlen_attn returns no log-sum-exp",
    ):
        resolve_backend("torch_varlen", CUDA, torch.bfloat16, needs)
    assert resolve_backend("auto", CUDA, torch.bfloat16, needs).name == "flash_attn"


@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_backend_accepts_sinks_at_start(name, kernels):
    needs = AttentionNeeds.of(AutoConfig.for_model("gpt_oss"))
    assert needs.sinks and needs.needs_eager_reference
    assert resolve_backend(name, CUDA, torch.bfloat16, needs).name == name


# -------------------------------------------------------------------------------- models
def gpt_oss(backend: str = "sdpa_varlen", dtype=torch.float64, **overrides):
    """A tiny gpt_oss (a sliding layer and a full one, both with sinks), prepared as ``build_model`` does."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt_oss", **(GPT_OSS | overrides))
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="eager")  # float64 experts
    model.config.use_cache = False
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.linspace(-2.0, 2.0, p.numel()))  # sinks that matter (their init is empty memory)
    return prepare_model(model, BACKENDS[backend])


def packed_and_alone(model, lengths, seed=1, device="cpu"):
    """Logits and every parameter's gradient of the summed token loss, the examples packed through the
    model's backend vs each alone through its padded path (eager: transformers' own sink attention)."""
    g = torch.Generator().manual_seed(seed)
    examples = [torch.randint(1, 97, (n,), generator=g).to(device) for n in lengths]

    def loss_of(logits, ids):
        return torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum")

    cu = torch.tensor([0, *lengths]).cumsum(0).to(device=device, dtype=torch.int32)
    pos = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    model.zero_grad(set_to_none=True)
    packed = model(input_ids=torch.cat(examples)[None], position_ids=pos, cu_seqlens=cu, max_seqlen=max(lengths))[0]
    sum(loss_of(p, e) for p, e in zip(packed.split(lengths), examples, strict=True)).backward()
    grads_packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    alone = []
    for e in examples:
        position_ids, attention_mask = torch.arange(len(e), device=device)[None], torch.ones_like(e)[None]
        out = model(input_ids=e[None], position_ids=position_ids, attention_mask=attention_mask)[0]
        loss_of(out, e).backward()
        alone.append(out.detach())
    grads_alone = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return list(packed.detach().split(lengths)), alone, grads_packed, grads_alone


def worst(a: dict | list, b: dict | list) -> float:
    pairs = zip(a.values(), b.values(), strict=True) if isinstance(a, dict) else zip(a, b, strict=True)
    return max(float((x - y).abs().max()) / max(1.0, float(y.abs().max())) for x, y in pairs)


@pytest.mark.parametrize("backend", ["sdpa_varlen", "sdpa_block_mask"])
def test_packed_gpt_oss_equals_one_by_one_in_float64(backend):
    """An independent probe (not the config verdict's): float64, logits and every gradient, the sinks'
    included; the examples cross the window of the sliding layer."""
    model = gpt_oss(backend)
    assert model.padded_attention == "eager"  # SDPA cannot apply sinks: the reference is transformers' eager
    packed, alone, g_packed, g_alone = packed_and_alone(model, [9, 1, 14, 5, 11, 3])
    assert g_packed.keys() == g_alone.keys() and any(n.endswith("sinks") for n in g_packed)
    assert worst(packed, alone) < 1e-12
    assert worst(g_packed, g_alone) < 1e-10


def test_the_gpt_oss_probe_would_see_the_sinks_dropped(monkeypatch):
    import trainer.model.backends_sdpa as backends_sdpa

    monkeypatch.setattr(backends_sdpa, "sinks_of", lambda backend, kwargs: None)
    monkeypatch.setattr(backends_sdpa, "refuse_unhonoured", lambda *a, **k: None)
    packed, alone, g_packed, g_alone = packed_and_alone(gpt_oss(), [9, 1, 14, 5, 11, 3])
    assert worst(packed, alone) > 1e-2


@pytest.mark.parametrize("family", ["granite_swa", "granitemoe_swa", "flint", "mimo_v2_flash"])
def test_the_other_sink_families_are_exact_for_their_config(family):
    """Their eager attention applies the sink each its own way (a column of the softmax, or
    ``sigmoid(lse - sink)`` in float32): the certification's float64 replica finds each exact."""
    from trainer.model.certification.replica import judge

    if family not in AutoConfig.for_model.__globals__["CONFIG_MAPPING"]:
        pytest.skip(f"{family} is not in this transformers")
    found = judge(AutoConfig.for_model(family))
    assert found.outcome == "exact", found.detail


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "flex"])
def test_packed_gpt_oss_on_the_real_kernels(backend):
    """On a GPU (``launch/gpu_check.sh`` runs the ``gpu`` tests): the real kernels' lse, its gradient through
    ``KernelLSE`` (flash-attn, varlen_attn) or flex's own backward of it, at a real head dim (64), GQA, a
    sliding layer, against the eager reference; bf16 kernels (3e-2) or fp32 flex (1e-4)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    half = backend != "flex"
    dtype = torch.bfloat16 if half else torch.float32
    if reason := BACKENDS[backend].unavailable(torch.device("cuda"), dtype) or BACKENDS[backend].sinks_unavailable():
        pytest.skip(reason)
    model = gpt_oss(backend, dtype=torch.float32, head_dim=64, hidden_size=128, max_position_embeddings=256).to("cuda")
    model.backend = resolve_backend(backend, torch.device("cuda"), dtype, AttentionNeeds.of(model.config))
    tol = 3e-2 if half else 1e-4
    with torch.autocast("cuda", dtype=dtype, enabled=half):
        packed, alone, g_packed, g_alone = packed_and_alone(model, [9, 1, 140, 5, 11, 3], device="cuda")
    assert worst(packed, alone) < tol and worst(g_packed, g_alone) < tol


@pytest.mark.slow
def test_gpt_oss_trains_from_the_cli_with_the_self_check(tmp_path, cache_dir):
    """The issue's command: a tiny gpt_oss from the qwen2_tiny preset trains two steps on CPU (rc 0), the
    startup self-check on."""
    import subprocess
    import sys

    from tests.conftest import REPO

    overrides = "model.config_overrides={num_local_experts:4,num_experts_per_tok:2,head_dim:16,sliding_window:16}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.train",
            "model=qwen2_tiny",
            "model.family=gpt_oss",
            overrides,
            "data.num_records=400",
            "max_steps=2",
            f"run_dir={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PACKFSDP_CACHE": cache_dir, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "; self-check packed micro-batch" in proc.stdout and "2 steps on 1 rank" in proc.stdout, proc.stdout[-3000:]
