"""The ``varlen_kernels`` route of a token mixer: the whole packed row through the mixer's own forward, its
kernels handed the example boundaries.

transformers' mixers call module-level kernel functions of their modeling file (the same names in 5.17 and
5.25: ``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``,
``mamba2_chunk_scan``, ...), each resolved at import to an installed package or a torch fallback. Handed a
packed row, none of them gets the boundaries (5.25 passes ``cu_seqlens`` to the delta rule, never a
``seq_idx`` to the convolution), and a hub kernel (``kernels``) would be no different. On CUDA, with the
packages installed, this route swaps those names, for the duration of one packed call of the mixer, for
adapters that call the packages' varlen kernels with the boundaries:

| transformers' name                  | kernel                                                    | boundaries  |
|-------------------------------------|-----------------------------------------------------------|-------------|
| ``causal_conv1d_fn``                | ``causal_conv1d.causal_conv1d_fn`` (channel-last input)   | ``seq_idx`` |
| ``torch_chunk_gated_delta_rule``    | ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``       | ``cu_seqlens`` |
| ``chunk_kimi_delta_attention``      | ``fla.ops.kda.chunk_kda``                                 | ``cu_seqlens`` |
| ``mamba2_chunk_scan``               | ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` | ``seq_idx`` |
| ``mamba2_split_conv1d_scan_combined`` | none: ``None``, so the mixer takes its unfused path (the two above) | |

The packages are imported lazily (optional extras in pyproject.toml). The route applies to a mixer class only where
each kind of mixing it does has a varlen kernel among its modeling file's names, each installed, and no token-mixing
kernel without one is there (Mamba-1's ``mamba_selective_scan`` / ``mamba_inner_fn``: mamba_ssm has no varlen
selective scan): otherwise ``per_example`` runs, and the log says why. Single-step (cached decode) kernels raise if
a packed call reaches them. After each call the route checks that every kind of mixing the mixer does (a
convolution, a recurrence: ``trainer.model.mixers`` reads them from its modules) went through an adapter: a mixer
that mixed tokens some other way fails the step instead of training across the boundaries. The startup self-check
runs this route on the GPU against each example alone. CPU CI runs it through pure-torch doubles with the kernels'
signatures (``tests/gpu_sim/mixer_kernel_doubles.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections import Counter
from dataclasses import dataclass

import torch
from packaging.version import Version

from trainer.model.packed_layout import PackedLayout
from trainer.model.relay import BOUNDARY_KWARGS


class VarlenKernelError(RuntimeError):
    """A packed call of a mixer on the varlen route did not keep its examples apart through the kernels."""


@dataclass(frozen=True)
class VarlenKernel:
    kind: str
    """``convolution`` or ``recurrence``: what the mixer must have called by the end of a packed call."""
    package: str
    """The module the kernel lives in (imported on first use)."""
    function: str


VARLEN_KERNELS: dict[str, VarlenKernel] = {
    "causal_conv1d_fn": VarlenKernel("convolution", "causal_conv1d", "causal_conv1d_fn"),
    "torch_chunk_gated_delta_rule": VarlenKernel("recurrence", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "chunk_kimi_delta_attention": VarlenKernel("recurrence", "fla.ops.kda", "chunk_kda"),
    "mamba2_chunk_scan": VarlenKernel("recurrence", "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
}
"""transformers' module-level kernel names -> the varlen kernel that takes the boundaries."""
UNFUSED = frozenset({"mamba2_split_conv1d_scan_combined"})
"""Fused kernels replaced by ``None`` (the mixer then takes its unfused path through the kernels above)."""
SINGLE_STEP = frozenset(
    {
        "causal_conv1d_update",
        "torch_recurrent_gated_delta_rule",
        "recurrent_kimi_delta_attention",
        "mamba2_selective_state_update",
        "mamba_selective_state_update",
    }
)
"""Cached decode steps: never part of a training forward; an adapter raises if one is reached."""
NO_VARLEN = frozenset({"mamba_selective_scan", "mamba_inner_fn"})
"""Token-mixing kernels without a varlen kernel (Mamba-1's selective scan): their mixers run per example."""


def kernels_run_on(device: torch.device | None) -> bool:
    """The varlen kernels run on ``device`` (CUDA)."""
    return device is not None and torch.device(device).type == "cuda"


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package missing
        return False


def varlen_names(module: torch.nn.Module, kinds: set[str]) -> tuple[list[str], str | None]:
    """(transformers' kernel names this route swaps for ``module``'s class, why the route cannot run or None).
    ``kinds``: what the mixer does (``convolution``, ``recurrence``), each of which needs a varlen kernel."""
    names = vars(sys.modules[type(module).__module__])
    found = [n for n in VARLEN_KERNELS if n in names]
    if blocked := sorted(n for n in NO_VARLEN if n in names):
        return found, f"{', '.join(blocked)} has no varlen kernel"
    if not found or not kinds:  # nothing the route knows how to hand the boundaries (xLSTM, RWKV)
        return found, "its modeling file calls no kernel that takes the boundaries"
    if uncovered := sorted(kinds - {VARLEN_KERNELS[n].kind for n in found}):
        return found, f"its modeling file calls no varlen kernel for its {' and '.join(uncovered)}"
    if missing := sorted(
        {VARLEN_KERNELS[n].package.split(".")[0] for n in found if not _installed(VARLEN_KERNELS[n].package)}
    ):
        return found, f"{', '.join(missing)} not installed"
    return found + sorted((UNFUSED | SINGLE_STEP) & names.keys()), None


FLA_DELTA_RULES = frozenset({"torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention"})
"""transformers' delta-rule names that take an installed fla's kernel, in its own path too (5.17's
``use_kernel_func_from_hub_with_fallback`` prefers an installed package to the torch fallback)."""


def fla_refusal(module: torch.nn.Module, device: torch.device | None) -> str | None:
    """Why the installed flash-linear-attention cannot train ``module`` on ``device``, or None: fla refuses
    its gated delta-rule backward on Hopper with Triton >= 3.4, < 3.7.1 unless tilelang is installed ("produces
    incorrect results"; seen on an H200, fla 0.6.0, Triton 3.6), at the first backward, deep in a step, on
    either route (transformers' own delta rule calls an installed fla)."""
    if not kernels_run_on(device) or not FLA_DELTA_RULES & vars(sys.modules[type(module).__module__]).keys():
        return None
    if not _installed("fla") or _installed("tilelang") or not _installed("triton"):
        return None
    if torch.cuda.get_device_capability(device)[0] != 9:
        return None
    triton = importlib.import_module("triton")
    if not Version("3.4.0") <= Version(triton.__version__) < Version("3.7.1"):
        return None
    return (
        f"flash-linear-attention refuses its gated delta-rule backward on Hopper with Triton {triton.__version__} "
        f"(incorrect results there; {type(module).__name__} would stop at the first backward): upgrade Triton to "
        "3.7.1 or later, install tilelang, or uninstall flash-linear-attention"
    )


def _kernel(name: str):
    spec = VARLEN_KERNELS[name]
    return getattr(importlib.import_module(spec.package), spec.function)


class _Boundaries:
    """``seq_idx`` (``[1, T]`` int32: each token's example) and ``cu_seqlens`` (int64) of one packed call,
    made once per forward (kept with the layout every layer of the forward shares)."""

    def __init__(self, cu: torch.Tensor) -> None:
        layout = PackedLayout.of(cu)

        def make() -> tuple[torch.Tensor, torch.Tensor]:
            lengths = torch.tensor(layout.lengths, device=cu.device)
            examples = torch.arange(len(layout.lengths), device=cu.device, dtype=torch.int32)
            return cu.to(torch.long), torch.repeat_interleave(examples, lengths, output_size=layout.total)[None]

        self.cu_seqlens, self.seq_idx = layout.cached("mixer:boundaries", make)


def _conv_adapter(boundaries: _Boundaries, calls: Counter):
    """transformers' ``causal_conv1d_fn`` -> causal_conv1d's, handed ``seq_idx``."""

    def conv(hidden_states, weight, bias=None, activation=None, **_):
        calls["convolution"] += 1
        channel_last = hidden_states.transpose(1, 2).contiguous().transpose(1, 2)  # what seq_idx needs
        return _kernel("causal_conv1d_fn")(
            channel_last, weight, bias, seq_idx=boundaries.seq_idx, activation=activation
        )

    return conv


def _delta_rule_adapter(name: str, boundaries: _Boundaries, calls: Counter):
    """transformers' delta rule ``name`` -> fla's, handed ``cu_seqlens``; an initial state is refused."""

    def run(
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **_,
    ):
        calls["recurrence"] += 1
        if initial_state is not None:
            raise VarlenKernelError(f"{name} got an initial state in a packed call")
        return _kernel(name)(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=None,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=boundaries.cu_seqlens,
        )

    return run


def _chunk_scan_adapter(boundaries: _Boundaries, calls: Counter):
    """transformers' ``mamba2_chunk_scan`` -> mamba_ssm's, handed ``seq_idx``; an initial or final state is
    refused."""

    def chunk_scan(
        hidden_states,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        dt_bias=None,
        initial_states=None,
        dt_softplus=False,
        dt_limit=(0.0, float("inf")),
        return_final_states=False,
        z=None,
        **_,
    ):
        calls["recurrence"] += 1
        if initial_states is not None or return_final_states:
            raise VarlenKernelError(
                "mamba2_chunk_scan got an initial state or was asked for a final one in a packed call"
            )
        return _kernel("mamba2_chunk_scan")(
            hidden_states,
            dt,
            A,
            B,
            C,
            chunk_size,
            D=D,
            z=z,
            dt_bias=dt_bias,
            seq_idx=boundaries.seq_idx,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
        )

    return chunk_scan


def _unfused(*_args, **_kwargs):
    """A fused kernel's stand-in: ``None`` sends the mixer down its unfused path."""
    return None


def _single_step(name: str):
    """A stand-in for the cached single-step kernel ``name`` that raises if a packed call reaches it."""

    def refuse(*_args, **_kwargs):
        raise VarlenKernelError(f"a packed call reached {name}, a cached single-step kernel")

    return refuse


def _adapters(boundaries: _Boundaries, calls: Counter) -> dict:
    """transformers' signatures -> the varlen kernels, each call counted by kind."""
    adapters = {
        "causal_conv1d_fn": _conv_adapter(boundaries, calls),
        "torch_chunk_gated_delta_rule": _delta_rule_adapter("torch_chunk_gated_delta_rule", boundaries, calls),
        "chunk_kimi_delta_attention": _delta_rule_adapter("chunk_kimi_delta_attention", boundaries, calls),
        "mamba2_chunk_scan": _chunk_scan_adapter(boundaries, calls),
    }
    adapters |= dict.fromkeys(UNFUSED, _unfused) | {n: _single_step(n) for n in SINGLE_STEP}
    return adapters


class VarlenKernels:
    """The mixer's own forward over the whole row, its kernels swapped for varlen ones (module docstring)."""

    name = "varlen_kernels"

    def __init__(self, names: list[str], kinds: set[str]) -> None:
        self.names = names
        self.kinds = kinds
        """What each packed call must have run through an adapter (``convolution``, ``recurrence``)."""

    def describe(self) -> str:
        kernels = sorted(
            {f"{VARLEN_KERNELS[n].package}.{VARLEN_KERNELS[n].function}" for n in self.names if n in VARLEN_KERNELS}
        )
        return f"varlen_kernels ({', '.join(kernels)}, handed the example boundaries)"

    def run(self, module, forward, boundaries: dict, args: tuple, kwargs: dict):
        return _varlen_run(self, module, forward, boundaries, args, kwargs)


@torch.compiler.disable  # swaps module globals per call
def _varlen_run(route: VarlenKernels, module, forward, boundaries: dict, args: tuple, kwargs: dict):
    namespace = vars(sys.modules[type(module).__module__])
    calls: Counter = Counter()
    adapters = _adapters(_Boundaries(boundaries["cu_seq_lens_q"]), calls)
    saved = {n: namespace[n] for n in route.names}
    namespace.update({n: adapters[n] for n in route.names})
    try:
        out = forward(*args, **{k: v for k, v in kwargs.items() if k not in BOUNDARY_KWARGS})
    finally:
        namespace.update(saved)
    if missing := sorted(route.kinds - set(calls)):
        raise VarlenKernelError(
            f"{type(module).__name__} ran a packed call without its varlen {' and '.join(missing)} kernel: it mixed "
            "tokens some other way (a transformers version this route does not know); use the per_example route"
        )
    return out


__all__ = [
    "NO_VARLEN",
    "SINGLE_STEP",
    "UNFUSED",
    "VARLEN_KERNELS",
    "VarlenKernelError",
    "VarlenKernels",
    "fla_refusal",
    "kernels_run_on",
    "varlen_names",
]
