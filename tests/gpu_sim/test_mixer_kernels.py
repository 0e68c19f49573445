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
