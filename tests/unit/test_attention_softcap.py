"""Attention logit softcapping (Gemma2's ``softcap``) and the selections no backend implements: honoured
where the kernel can (``flash_attn`` passes ``softcap`` to flash-attn, ``flex`` applies it as a
``score_mod``), refused otherwise: at resolution, from the model's config, with one line naming the family
and the argument, and again inside every backend if the argument arrives anyway. Never ignored. (Attention
sinks, gpt-oss's ``s_aux``, every backend applies: tests/unit/test_attention_sinks.py.)

``flash_attn`` runs through the flash-attn double of tests/gpu_sim (which implements ``softcap``); ``flex``
runs forward on CPU (eager), where it has no backward.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.gpu_sim import flash_attn_double
from tests.gpu_sim.device import pretend_capable_gpu
from tests.unit.test_attention_backends import call, qkv
from trainer.config import JobConfig, ModelConfig
from trainer.model import BACKENDS, AttentionBackendError, AttentionNeeds, VarlenCausalLM, resolve_backend

CUDA = torch.device("cuda")  # only named: the device predicates are patched, nothing runs on it
BF16 = torch.bfloat16
SOFTCAP = 0.5
"""Small enough that capping changes every score, so a backend that dropped it would be far off."""

GEMMA2 = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    sliding_window=6,
    attn_logit_softcapping=SOFTCAP,
)
GEMMA2_NEEDS = AttentionNeeds.of(AutoConfig.for_model("gemma2", attn_logit_softcapping=50.0))
SINK_NEEDS = AttentionNeeds.of(AutoConfig.for_model("gpt_oss"))
NO_SOFTCAP = ["torch_varlen", "sdpa_varlen", "sdpa_block_mask"]


@pytest.fixture
def capable_gpu(monkeypatch):
    """Every backend can run (flash-attn double installed, device predicates pass): only the needs decide."""
    flash_attn_double.install(monkeypatch)
    pretend_capable_gpu(monkeypatch)


def softcapped_reference(q, k, v, lengths, scale, softcap):
    """Per-example causal attention of capped scores in float64: ``[1, H, T, D]`` -> ``[1, T, H, D]``."""
    q, k, v = (x.double() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    outs, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        scores = softcap * torch.tanh(q[:, :, s] @ k[:, :, s].transpose(-1, -2) * scale / softcap)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        outs.append(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, :, s])
        start += n
    return torch.cat(outs, 2).transpose(1, 2)


# -------------------------------------------------------------------------------- what the config says
def test_needs_are_read_from_the_config():
    assert (GEMMA2_NEEDS.family, GEMMA2_NEEDS.softcap, GEMMA2_NEEDS.sinks) == ("gemma2", 50.0, False)
    assert (SINK_NEEDS.family, SINK_NEEDS.softcap, SINK_NEEDS.sinks) == ("gpt_oss", None, True)
    plain = AttentionNeeds.of(AutoConfig.for_model("llama"))
    assert (plain.softcap, plain.sinks, plain.dropout) == (None, False, 0.0)
    assert AttentionNeeds.of(AutoConfig.for_model("gemma2", attn_logit_softcapping=None)).softcap is None


# -------------------------------------------------------------------------------- resolution, at start
@pytest.mark.parametrize("name", NO_SOFTCAP)
def test_a_backend_without_softcap_is_refused_naming_family_and_argument(name, capable_gpu):
    with pytest.raises(AttentionBackendError) as e:
        resolve_backend(name, CUDA, BF16, needs=GEMMA2_NEEDS)
    message = str(e.value)
    assert "\n" not in message
    assert f"model.attention={name}" in message
    assert "gemma2's attention softcapping (attn_logit_softcapping=50.0)" in message
    assert "use model.attention=flash_attn or flex" in message


@pytest.mark.parametrize("name", ["flash_attn", "flex"])
def test_softcap_capable_backends_are_accepted(name, capable_gpu):
    assert resolve_backend(name, CUDA, BF16, needs=GEMMA2_NEEDS).name == name


def test_auto_skips_backends_that_cannot_softcap(monkeypatch):
    pretend_capable_gpu(monkeypatch)  # no flash-attn: auto would take torch_varlen for a plain model
    assert resolve_backend("auto", CUDA, BF16).name == "torch_varlen"
    assert resolve_backend("auto", CUDA, BF16, needs=GEMMA2_NEEDS).name == "flex"
    with pytest.raises(AttentionBackendError, match="sdpa_varlen: it cannot honour gemma2's attention softcapping"):
        resolve_backend("auto", torch.device("cpu"), needs=GEMMA2_NEEDS)  # CPU: neither capable one runs


def test_the_trainer_resolves_against_the_model_config(capable_gpu):
    from trainer.pipeline import resolve_attention

    gemma2 = ModelConfig(family="gemma2", attention="torch_varlen", config_overrides=GEMMA2)
    with pytest.raises(AttentionBackendError, match=f"attn_logit_softcapping={SOFTCAP}"):
        resolve_attention(JobConfig(model=gemma2), CUDA)
    gemma2.attention = "auto"
    assert resolve_attention(JobConfig(model=gemma2), CUDA).name == "flash_attn"


# -------------------------------------------------------------------------------- inside the backends
@pytest.mark.parametrize("name", NO_SOFTCAP)
def test_a_backend_without_softcap_refuses_the_kwarg(name):
    q, k, v = qkv([3, 4])
    with pytest.raises(AttentionBackendError, match=rf"model.attention={name} .*softcapping \(softcap=30.0\)"):
        call_with(BACKENDS[name].fn, q, k, v, [3, 4], softcap=30.0)


@pytest.mark.parametrize("argument", ["indices", "block_indices", "sinks", "position_bias"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_backend_refuses_a_selection_it_does_not_implement(name, argument):
    """DSA's ``indices``, MiniMax-M3's ``block_indices``, Inkling2's ``sinks``, a ``position_bias``: never
    ignored (their families are refused at build; this is the second line)."""
    q, k, v = qkv([3, 4])
    with pytest.raises(
        AttentionBackendError, match=rf"model.attention={name} cannot honour .*\({argument}\): no packed"
    ):
        call_with(BACKENDS[name].fn, q, k, v, [3, 4], **{argument: torch.zeros(1)})


def call_with(fn, q, k, v, lengths, **extra):
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    out, _ = fn(
        SimpleNamespace(is_causal=True),
        q,
        k,
        v,
        None,
        scaling=0.3,
        dropout=0.0,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max(lengths),
        max_length_k=max(lengths),
        **extra,
    )
    return out


def test_flash_attn_passes_softcap_to_the_kernel(monkeypatch):
    flash_attn_double.install(monkeypatch)
    lengths = [7, 1, 12]
    q, k, v = (x.to(BF16) for x in qkv(lengths, kv_heads=2))
    out = call_with(BACKENDS["flash_attn"].fn, q, k, v, lengths, softcap=SOFTCAP)
    expected = softcapped_reference(q, k, v, lengths, 0.3, SOFTCAP)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)
    assert (call(BACKENDS["flash_attn"].fn, q, k, v, lengths).double() - expected).abs().max() > 0.1


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_applies_softcap_as_a_score_mod():
    lengths = [7, 1, 12]
    q, k, v = (x.detach() for x in qkv(lengths, kv_heads=2))  # flex has no backward on CPU
    out = call_with(BACKENDS["flex"].fn, q, k, v, lengths, softcap=SOFTCAP)
    torch.testing.assert_close(out.double(), softcapped_reference(q, k, v, lengths, 0.3, SOFTCAP), atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------------------- a Gemma2 model, packed
def gemma2_model(backend: str) -> VarlenCausalLM:
    """A tiny softcapped Gemma2 behind ``backend``; its padded path is transformers' eager attention, which
    softcaps (Gemma2 has no SDPA path)."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma2", **GEMMA2))
    hf.config.use_cache = False
    with torch.no_grad():  # random init leaves scores near 0, where capping changes nothing: widen them
        for name, p in hf.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(30)
    return VarlenCausalLM(hf, BACKENDS[backend])


def gemma2_packed_and_alone(backend: str, lengths: list[int]):
    """Logits of the examples packed through ``backend`` and each alone through the padded path."""
    model = gemma2_model(backend)
    g = torch.Generator().manual_seed(1)
    exs = [torch.randint(0, 97, (n,), generator=g) for n in lengths]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = model(input_ids=torch.cat(exs)[None], position_ids=pos, cu_seqlens=cu, max_seqlen=max(lengths))[0]
    alone = [
        model(input_ids=e[None], position_ids=torch.arange(len(e))[None], attention_mask=torch.ones_like(e)[None])[0]
        for e in exs
    ]
    return list(packed.split(lengths)), alone


@pytest.mark.parametrize("backend", ["flash_attn", "flex"])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_packed_gemma2_with_softcapping_equals_one_by_one(backend, monkeypatch):
    flash_attn_double.install(monkeypatch, accept_fp32=True)  # fp32: the plumbing, exactly
    with torch.no_grad():
        packed, alone = gemma2_packed_and_alone(backend, [9, 1, 14, 5])
    for p, a in zip(packed, alone, strict=True):
        torch.testing.assert_close(p, a, atol=1e-5, rtol=1e-5)


def test_packed_gemma2_gradients_equal_one_by_one_through_flash_attn(monkeypatch):
    from tests.unit.test_model_families import assert_equivalent, examples

    flash_attn_double.install(monkeypatch, accept_fp32=True)
    assert_equivalent(gemma2_model("flash_attn"), examples(), atol=1e-5, rtol=1e-5)


def test_the_gemma2_check_would_see_softcap_dropped(monkeypatch):
    """The model test above is sensitive: the same model with softcapping ignored is far off."""
    flash_attn_double.install(monkeypatch, accept_fp32=True)
    monkeypatch.setitem(GEMMA2, "attn_logit_softcapping", None)  # packed run uncapped...
    with torch.no_grad():
        packed, _ = gemma2_packed_and_alone("flash_attn", [9, 1, 14, 5])
    monkeypatch.setitem(GEMMA2, "attn_logit_softcapping", SOFTCAP)  # ...the reference capped
    with torch.no_grad():
        _, alone = gemma2_packed_and_alone("flash_attn", [9, 1, 14, 5])
    assert max((p - a).abs().max() for p, a in zip(packed, alone, strict=True)) > 1e-2


@pytest.fixture(params=[False, True], ids=["flag_as_5.24", "flag_as_5.17"])
def gemma2_sdpa_flag(request, monkeypatch):
    """Gemma2's ``_supports_sdpa`` as each release has it (5.17: True, though SDPA cannot softcap): the
    padded path and the self-check's reference must read the config's softcap, not the flag."""
    from transformers.models.gemma2 import modeling_gemma2 as gemma2

    for cls in (gemma2.Gemma2PreTrainedModel, gemma2.Gemma2Model, gemma2.Gemma2ForCausalLM):
        monkeypatch.setattr(cls, "_supports_sdpa", request.param)
    return request.param


def test_the_padded_path_softcaps_whatever_the_class_flag_says(gemma2_sdpa_flag, monkeypatch):
    flash_attn_double.install(monkeypatch, accept_fp32=True)
    assert gemma2_model("flash_attn").padded_attention == "eager"
    with torch.no_grad():
        packed, alone = gemma2_packed_and_alone("flash_attn", [9, 1, 14, 5])
    for p, a in zip(packed, alone, strict=True):
        torch.testing.assert_close(p, a, atol=1e-5, rtol=1e-5)


def test_the_padded_attention_follows_the_config(monkeypatch):
    from transformers import LlamaForCausalLM

    from trainer.model.wrapper import padded_attention

    llama = LlamaForCausalLM(
        AutoConfig.for_model(
            "llama",
            **{
                k: GEMMA2[k]
                for k in (
                    "vocab_size",
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                )
            },
        )
    )
    assert padded_attention(llama) == "sdpa"
    monkeypatch.setattr(LlamaForCausalLM, "_supports_sdpa", False)  # a class without an SDPA path: eager
    assert padded_attention(llama) == "eager"
    monkeypatch.setattr(llama.config, "model_type", "gpt_oss")  # sinks: eager whatever the flag
    monkeypatch.setattr(LlamaForCausalLM, "_supports_sdpa", True)
    assert padded_attention(llama) == "eager"


def test_a_gemma2_run_builds_and_passes_the_self_check(gemma2_sdpa_flag, monkeypatch, tokenizer, small_dataset):
    """End to end as the trainer does it: resolve from the config, build (eager where SDPA cannot
    softcap, whatever the release's class flag), self-check a packed micro-batch; a backend that got past
    resolution is stopped there."""
    from trainer.collate import collate_packed
    from trainer.model import build_model, measure
    from trainer.pipeline import resolve_attention

    flash_attn_double.install(monkeypatch, accept_fp32=True)
    pretend_capable_gpu(monkeypatch)
    overrides = {k: v for k, v in GEMMA2.items() if k != "vocab_size"} | {"max_position_embeddings": 512}
    cfg = JobConfig(model=ModelConfig(family="gemma2", config_overrides=overrides))
    backend = resolve_attention(cfg, CUDA)
    model = build_model(cfg.model, tokenizer, backend, seed=0)
    assert model.padded_attention == "eager"
    batch = collate_packed(small_dataset, [3, 17, 42, 5], tokenizer.pad_token_id)
    result = measure(model, batch)
    assert result.ok, result.line()
    model.backend = BACKENDS["sdpa_varlen"]
    with pytest.raises(AttentionBackendError, match="sdpa_varlen cannot honour the model's attention softcapping"):
        measure(model, batch)
