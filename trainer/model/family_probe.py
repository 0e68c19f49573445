"""Probe a transformers causal-LM family: does a packed row train exactly what its examples train one by one?

``probe(model_type)`` builds a tiny random model of the family (2 layers, small width, a sliding window of
6 where the family has one), prepared as ``build_model`` prepares it (``prepare_model``: per-example rope,
the boundary relay) with the loss a run trains with by default (``LossConfig().impl``: the chunked loss,
through the decoder stack). A packed row of examples of lengths 9, 1, 14, 5, 11, 3 runs the trainer's step
through ``sdpa_varlen`` (``summed_token_loss`` / the label count, backward) and is compared with the same
examples run alone through transformers' own attention and full-logit cross-entropy: logits, the loss and
every parameter's gradient, fp32 (a near miss rerun in float64). An exact family then takes one optimizer
step (the trainer's default AdamW, clipping) and is compared again on the updated weights: it must not
crash, and stay exact.
``benchmarks/family_matrix.py`` runs it over every family of the installed transformers;
``tests/unit/test_family_matrix.py`` checks the verdicts of ``trainer.model.families`` against it.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from trainer.collate import IGNORE_INDEX, Batch
from trainer.loss import summed_token_loss

LENGTHS = (9, 1, 14, 5, 11, 3)
"""Longer and shorter than the window, a 1-token example."""
WINDOW = 6
VOCAB = 128
TOLERANCE = 1e-5
ROUNDING_SUSPECT = 1e-3
"""A difference under this in fp32 is rerun in float64 (``rounding_only``) before it is called wrong."""
FLOAT64_TOLERANCE = (1e-12, 1e-6)
"""(logits, gradients) in float64: logits must agree to rounding; gradients may keep the float32 steps some
families take inside (Gemma 4: ~1e-7), still 100x below what a leak between examples gives."""

SHRINK = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128, "ffn_hidden_size": 128,
    "n_inner": 128, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "num_attention_heads": 4,
    "n_head": 4, "num_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB,
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "sliding_window": WINDOW,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2, "decoder_start_token_id": 1, "use_cache": False, "tie_word_embeddings": False,
    "decoder_layers": 2, "encoder_layers": 1, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "decoder_ffn_dim": 128, "encoder_ffn_dim": 128, "n_embed": 64, "num_decoder_layers": 2,
    "n_layers": 2, "n_heads": 4, "max_seq_len": 64, "index_head_dim": 16, "index_n_heads": 2,
    "embedding_dim": 64, "num_blocks": 2, "expert_ffn_hidden_size": 32, "zero_expert_num": 2,
    "linear_head_dim": 16, "linear_num_heads": 4, "num_expert_group": 1, "attention_hidden_size": 128,
    "attention_head_dim": 32, "mamba_dt_rank": 8, "model_max_length": 64, "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    # state-space / linear-attention mixers (trainer.model.mixers): heads x head dim = expand x hidden
    "num_experts_per_token": 2, "expand": 1, "state_size": 16, "n_groups": 1, "mamba_n_heads": 8,
    "mamba_d_head": 16, "mamba_d_state": 16, "mamba_d_ssm": 128, "mamba_n_groups": 1, "mamba_chunk_size": 8,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_mamba_heads": 8, "mamba_headdim": 16,
    "hybrid_layer_ids": [1],  # Zamba2's second (hybrid) layer of the two
}
"""Tiny values for the config fields a family has (a field the family lacks is left out)."""
NO_DROPOUT = (
    "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob",
    "attention_probs_dropout_prob", "dropout", "activation_dropout", "embedding_dropout", "mlp_dropout",
)


@dataclass(frozen=True)
class ProbeResult:
    family: str
    outcome: str
    """``exact``, ``wrong`` (ran, disagrees), ``error`` (the packed run raised), ``refused`` (packfsdp refused
    it while building) or ``unbuildable`` (no tiny model: no verdict)."""
    detail: str = ""
    logit_diff: float = float("nan")
    grad_diff: float = float("nan")
    loss_diff: float = float("nan")

    def line(self) -> str:
        if self.outcome in ("exact", "wrong"):
            return (
                f"{self.family}: {self.outcome} ({self.detail}max |logit diff| {self.logit_diff:.2g}, "
                f"|loss diff| {self.loss_diff:.2g}, |grad diff| {self.grad_diff:.2g})"
            )
        return f"{self.family}: {self.outcome}: {self.detail}"


def tiny_config(model_type: str, **overrides):
    """The family's transformers config shrunk to a tiny 2-layer model (``SHRINK``), dropout off."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    fields = set(default.to_dict()) | set(vars(default))
    values = {k: v for k, v in SHRINK.items() if k in fields}
    if "qk_rope_head_dim" in fields:  # multi-head latent attention: its head dims are the qk_* ones
        values["head_dim"] = SHRINK["qk_rope_head_dim"]
    if "rotary_dim" in fields:
        values["rotary_dim"] = 8
    values.update({k: 0.0 for k in NO_DROPOUT if k in fields})
    layer_types = getattr(default, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and layer_types:
        distinct = list(dict.fromkeys(layer_types))[:2]  # both kinds of layer where there are two
        try:
            return AutoConfig.for_model(model_type, **(values | {"layer_types": (distinct * 2)[:2]} | overrides))
        except (AttributeError, ValueError, KeyError, TypeError):  # a family that derives its layer types
            pass
    return AutoConfig.for_model(model_type, **(values | overrides))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:200]


def _token_loss_sum(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")


class Run(NamedTuple):
    """What a packed or one-by-one run of the probe's examples gives."""

    logits: list[torch.Tensor]
    """Each example's logits."""
    grads: dict[str, torch.Tensor]
    """Every parameter's gradient of the summed token loss."""
    loss: float
    """The summed token loss."""


class Diffs(NamedTuple):
    """Packed vs one by one, each relative to max(1, |one by one|)."""

    logits: float
    loss: float
    grads: float

    @property
    def worst(self) -> float:
        """The largest of the three; ``inf`` where one is not finite (a NaN never passes)."""
        return max(self) if all(math.isfinite(d) for d in self) else math.inf


def _grads(model, scale: float = 1.0) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() * scale for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def run_alone(model, examples: list[torch.Tensor]) -> Run:
    """Each example run alone through transformers' own attention (the model's padded path) and its full
    logits' cross-entropy: the reference, independent of the packed backend and of the run's loss."""
    model.zero_grad(set_to_none=True)
    logits, loss = [], 0.0
    for e in examples:
        out = model(input_ids=e[None], position_ids=torch.arange(len(e))[None], attention_mask=torch.ones_like(e)[None])[0]
        token_loss = _token_loss_sum(out, e)
        token_loss.backward()
        logits.append(out.detach())
        loss += float(token_loss.detach())
    return Run(logits, _grads(model), loss)


def packed_batch(examples: list[torch.Tensor]) -> Batch:
    """The examples as the trainer's collate lays out a packed row: one flat row, positions restarting,
    ``cu_seqlens``, and no label on each example's first token."""
    cu = torch.tensor([0] + [len(e) for e in examples]).cumsum(0).to(torch.int32)
    labels = torch.cat([torch.cat([torch.tensor([IGNORE_INDEX]), e[1:]]) for e in examples])[None]
    return Batch(
        input_ids=torch.cat(examples)[None], labels=labels,
        position_ids=torch.cat([torch.arange(len(e)) for e in examples])[None], cu_seqlens=cu,
        max_seqlen=max(len(e) for e in examples), num_examples=len(examples), num_tokens=int(cu[-1]),
        num_label_tokens=int((labels != IGNORE_INDEX).sum()), num_positions=int(cu[-1]),
    )


def run_packed(model, examples: list[torch.Tensor]) -> Run:
    """The examples in one packed row, as the trainer's step runs them: the loss the model is set to train
    with (``VarlenCausalLM.use_loss``: the chunked loss through the decoder and the boundary relay, by
    default) through ``summed_token_loss``, divided by the label count and backpropagated (``Trainer.
    forward_backward``); the gradients are scaled back to the summed loss's. The logits come from the same
    packed forward without labels."""
    model.zero_grad(set_to_none=True)
    batch = packed_batch(examples)
    with torch.no_grad():
        logits = model(**batch.model_inputs())[0]
    loss = summed_token_loss(model, batch)
    (loss / batch.num_label_tokens).backward()
    pieces = [logits[s:t] for s, t in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist())]
    return Run(pieces, _grads(model, batch.num_label_tokens), float(loss.detach()))


def differences(packed: Run, alone: Run) -> Diffs:
    """Max |logit diff|, |loss diff|, |grad diff| between two runs, each relative to max(1, |value|); a
    gradient present in one run only counts as infinite."""
    logit_diff = max(_max_rel_diff(p, a) for p, a in zip(packed.logits, alone.logits))
    loss_diff = abs(packed.loss - alone.loss) / max(1.0, abs(alone.loss))
    grad_diff = 0.0
    for name in packed.grads.keys() | alone.grads.keys():
        if name not in packed.grads or name not in alone.grads:
            return Diffs(logit_diff, loss_diff, float("inf"))
        grad_diff = max(grad_diff, _max_rel_diff(packed.grads[name], alone.grads[name]))
    return Diffs(logit_diff, loss_diff, grad_diff)


def optimizer_step(model, examples: list[torch.Tensor]) -> Diffs:
    """One training step on the packed row as the trainer takes it (the run's loss over the label count,
    gradient clipping, the default optimizer of ``trainer.optim.build_optimizer``), then packed vs one by
    one again on the updated weights; all ``inf`` where a weight is no longer finite."""
    from trainer.config import OptimConfig
    from trainer.optim import build_optimizer

    cfg = OptimConfig()
    batch = packed_batch(examples)
    optimizer = build_optimizer(model, cfg)
    model.zero_grad(set_to_none=True)
    (summed_token_loss(model, batch) / batch.num_label_tokens).backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], cfg.grad_clip, foreach=True)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        return Diffs(math.inf, math.inf, math.inf)
    return differences(run_packed(model, examples), run_alone(model, examples))


def build_probe_model(model_type: str, backend: str = "sdpa_varlen", **overrides):
    """The tiny model of ``model_type`` behind ``backend`` as ``build_model`` prepares it (``prepare_model``),
    without the family table's verdict (the probe is what makes it). Raises what building raises."""
    from transformers import AutoModelForCausalLM

    from trainer.config import LossConfig
    from trainer.model.attention import AttentionNeeds, resolve_backend
    from trainer.model.families import FamilyRefusedError, binding_window_dropped
    from trainer.model.prepare import prepare_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = tiny_config(model_type, **overrides)
        if reason := binding_window_dropped(config):  # the config-dependent refusals of check_family
            raise FamilyRefusedError(reason)
        resolved = resolve_backend(backend, torch.device("cpu"), torch.float32, AttentionNeeds.of(config))
        torch.manual_seed(0)
        model = prepare_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32), counted(resolved))
        model.use_loss(LossConfig().impl)  # the run's default loss (chunked), as the trainer sets it
        return model


def counted(backend):
    """``backend`` registered under its own name with a call counter (``backend.calls[0]``): a packed run
    that never calls it bypasses transformers' attention interface."""
    from transformers import AttentionInterface

    calls = [0]

    def fn(*args, **kwargs):
        calls[0] += 1
        return backend.fn(*args, **kwargs)

    probe_backend = dataclasses.replace(backend, name=f"{backend.name}_probe", fn=fn)
    AttentionInterface.register(probe_backend.hf_name, fn)
    object.__setattr__(probe_backend, "calls", calls)
    return probe_backend


def probe(model_type: str, backend: str = "sdpa_varlen", **overrides) -> ProbeResult:
    """Build a tiny ``model_type`` model as ``build_model`` prepares it and compare packed with one by one.
    A family whose attention softcapping the CPU backends refuse is probed with softcapping off (the
    backends that honour it, flash_attn and flex, are checked in tests/unit/test_attention_softcap.py)."""
    from trainer.model.packed_layout import AttentionBackendError

    note = ""
    try:
        try:
            model = build_probe_model(model_type, backend, **overrides)
        except AttentionBackendError as e:
            if "softcapping" not in str(e):
                return ProbeResult(model_type, "refused", _one_line(e))
            note = "softcap off; "
            model = build_probe_model(model_type, backend, **(overrides | {"attn_logit_softcapping": None}))
    except Exception as e:  # noqa: BLE001 - a refusal by packfsdp, or a tiny config transformers cannot build
        kind = "refused" if type(e).__name__ in ("FamilyRefusedError", "RopeError") else "unbuildable"
        return ProbeResult(model_type, kind, _one_line(e))
    g = torch.Generator().manual_seed(1)
    vocab = min(VOCAB, model.model.get_input_embeddings().num_embeddings)
    examples = [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]
    model.eval()  # gradients still flow; off: dropout and random routing (Phi-3.5-MoE's sparsemixer samples)
    try:
        alone = run_alone(model, examples)
    except Exception as e:  # noqa: BLE001 - transformers' own path fails on the tiny config: no verdict
        return ProbeResult(model_type, "unbuildable", "runs alone: " + _one_line(e))
    try:
        packed = run_packed(model, examples)
    except Exception as e:  # noqa: BLE001 - a family that crashes when packed is refused, with this reason
        return ProbeResult(model_type, "error", _one_line(e))
    if model.backend.calls[0] == 0:
        note += "the packed backend was never called; "
    diffs = differences(packed, alone)
    exact, note = within_tolerance(model, examples, diffs, note)
    if not exact:
        return ProbeResult(model_type, "wrong", note, diffs.logits, diffs.grads, diffs.loss)
    try:
        after = optimizer_step(model, examples)
    except Exception as e:  # noqa: BLE001 - a family whose packed step crashes in the optimizer or after it
        return ProbeResult(model_type, "error", "the optimizer step: " + _one_line(e))
    exact, after_note = within_tolerance(model, examples, after, "")
    if not exact:
        note += f"after one optimizer step: {after_note}|logit diff| {after.logits:.2g}, |loss diff| {after.loss:.2g}, |grad diff| {after.grads:.2g}; before: "
        return ProbeResult(model_type, "wrong", note, diffs.logits, diffs.grads, diffs.loss)
    return ProbeResult(model_type, "exact", note, diffs.logits, diffs.grads, diffs.loss)


def within_tolerance(model, examples: list[torch.Tensor], diffs: Diffs, note: str) -> tuple[bool, str]:
    """fp32 within ``TOLERANCE``, or a near miss that is rounding only (``rounding_only``). (exact, note)."""
    if diffs.worst <= TOLERANCE:
        return True, note
    if diffs.worst < ROUNDING_SUSPECT:
        return rounding_only(model, examples, note)
    return False, note


def rounding_only(model, examples: list[torch.Tensor], note: str) -> tuple[bool, str]:
    """Rerun a near miss in float64: a packing leak stays as large, fp32 rounding shrinks by orders of
    magnitude (a family with float32 steps inside keeps ~1e-7 on its gradients, the chunked loss's float32
    cross-entropy ~1e-8 on the loss). (exact, note)."""
    model.double()
    f64 = differences(run_packed(model, examples), run_alone(model, examples))
    model.float()
    exact = f64.worst < math.inf and f64.logits <= FLOAT64_TOLERANCE[0] and max(f64.loss, f64.grads) <= FLOAT64_TOLERANCE[1]
    note += f"float64: |logit diff| {f64.logits:.1g}, |loss diff| {f64.loss:.1g}, |grad diff| {f64.grads:.1g}; fp32: "
    return exact, note


__all__ = [
    "LENGTHS", "Diffs", "ProbeResult", "Run", "build_probe_model", "differences", "optimizer_step", "packed_batch",
    "probe", "run_alone", "run_packed", "tiny_config",
]
