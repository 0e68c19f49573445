"""The ``varlen_kernels`` route of token mixers on CPU, through doubles of causal-conv1d, fla and mamba_ssm.

tests/gpu_sim/mixer_kernel_doubles.py stands in for the packages (its docstring lists the contract it
checks); only the device predicate (``mixer_routes.kernels_run_on``) is patched, so the route is chosen,
swaps transformers' kernel names and runs as on a GPU. The reference is tests/unit/test_mixers.py's: each
example through the bare transformers model alone (transformers' torch fallbacks, never the doubles).
"""

from __future__ import annotations

import pytest

from tests.gpu_sim import mixer_kernel_doubles as doubles
from tests.unit.test_mixers import CONFIGS, LENGTHS, TOLERANCE, alone, build, examples, gap, packed
from trainer.model import mixer_routes
from trainer.model.mixers import describe, find_token_mixers

ROUTED = {
    "gated delta rule (qwen3_next)": (
        CONFIGS["gated delta rule (qwen3_next)"],
        ["causal_conv1d_fn", "chunk_gated_delta_rule"],
    ),
    "KDA (kimi_linear)": (CONFIGS["KDA (kimi_linear)"], ["causal_conv1d_fn", "chunk_kda"]),
    "Mamba-2 scan (nemotron_h)": (CONFIGS["Mamba-2 (nemotron_h)"], ["causal_conv1d_fn", "mamba_chunk_scan_combined"]),
    "short convolution (lfm2)": (CONFIGS["short convolution (lfm2)"], ["causal_conv1d_fn"]),
}


@pytest.fixture
def kernels(monkeypatch):
    """The doubles installed and the device predicate passing: ``install(packages)`` picks the packages."""
    monkeypatch.setattr(mixer_routes, "kernels_run_on", lambda device: True)

    def install(packages=("causal_conv1d", "fla", "mamba_ssm")):
        doubles.install(monkeypatch, packages)

    return install


def routes(model) -> set[str]:
    return {m.module.forward.route.name for m in find_token_mixers(model.model)}


@pytest.mark.parametrize("kind", list(ROUTED))
def test_varlen_kernels_keep_each_example_alone(kind, kernels):
    (family, overrides, lengths), called = ROUTED[kind]
    kernels()
    model = build(family, overrides)
    assert routes(model) == {"varlen_kernels"}
    exs = examples(lengths)
    reference = alone(model, exs)  # transformers' torch fallbacks, one example at a time
    doubles.CALLS.clear()
    assert gap(packed(model, exs), reference) < TOLERANCE
    for kernel in called:
        assert doubles.CALLS[f"{kernel}:bounded"] == doubles.CALLS[kernel] > 0, (kernel, doubles.CALLS)


def test_the_comparison_sees_a_kernel_that_drops_the_boundaries(kernels, monkeypatch):
    original = doubles.causal_conv1d_fn
    monkeypatch.setattr(
        doubles,
        "causal_conv1d_fn",
        lambda x, weight, bias=None, seq_idx=None, **kw: original(x, weight, bias, None, **kw),
    )
    kernels()
    model = build(*CONFIGS["short convolution (lfm2)"])
    exs = examples(LENGTHS)
    assert gap(packed(model, exs), alone(model, exs)) > 1e-3


def test_without_a_varlen_kernel_the_mixer_runs_per_example_and_says_why(kernels):
    kernels(("causal_conv1d",))  # no fla: the delta rule has no varlen kernel here
    model = build(*CONFIGS["gated delta rule (qwen3_next)"])
    mamba1 = build(*CONFIGS["state-space scan, Mamba-1 (falcon_mamba)"])  # mamba_ssm: no varlen selective scan
    assert routes(model) == routes(mamba1) == {"per_example"}
    assert "varlen kernels not used: fla not installed" in describe(model.token_mixers)[0]
    assert "mamba_selective_scan has no varlen kernel" in describe(mamba1.token_mixers)[0]
    kernels()  # every package: MiniMax's lightning attention has no kernel that takes the boundaries
    lightning = build("minimax", dict(layer_types=["linear_attention", "full_attention"], num_local_experts=2))
    assert "varlen kernels not used: its modeling file calls no" in describe(lightning.token_mixers)[0]


@pytest.mark.parametrize(
    ("capability", "triton", "tilelang", "refused"),
    [
        ((9, 0), "3.6.0", False, True),  # the H200 of the first GPU check
        ((9, 0), "3.7.1", False, False),
        ((9, 0), "3.6.0", True, False),
        ((8, 0), "3.6.0", False, False),
    ],
)
def test_an_fla_that_refuses_its_backward_on_hopper_is_refused_at_build(
    capability, triton, tilelang, refused, monkeypatch
):
    """fla 0.6.0 raised at the first backward on an H200 with Triton 3.6 ("produces incorrect results for gated
    chunk_bwd_dqkwg"), in transformers' own delta rule too: the build names it in one line instead."""
    import types

    from trainer.config import ConfigError
    from trainer.model import mixer_kernels

    monkeypatch.setattr(mixer_routes, "kernels_run_on", lambda device: True)
    monkeypatch.setattr(mixer_kernels, "kernels_run_on", lambda device: True)
    installed = {"fla": True, "triton": True, "tilelang": tilelang, "causal_conv1d": False, "mamba_ssm": False}
    monkeypatch.setattr(mixer_kernels, "_installed", lambda package: installed.get(package.split(".")[0], False))
    monkeypatch.setattr(mixer_kernels.torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setitem(__import__("sys").modules, "triton", types.SimpleNamespace(__version__=triton))
    family, overrides, _ = CONFIGS["gated delta rule (qwen3_next)"]
    if refused:
        with pytest.raises(ConfigError, match=f"flash-linear-attention refuses .* Triton {triton} .*Qwen3Next"):
            build(family, overrides)
    else:
        build(family, overrides)
    build(*CONFIGS["short convolution (lfm2)"][:2])  # no delta rule: never refused
