"""Probe a transformers causal-LM family: is a packed row exact against its examples run one by one?

``probe(model_type)`` builds a tiny random model of the family (2 layers, small width, a sliding window of
6 where the family has one), prepares it as ``build_model`` does (``prepare_model``: per-example rope) and
compares a packed row of examples of lengths 9, 1, 14, 5, 11, 3 through ``sdpa_varlen`` with the same
examples run alone through transformers' own attention: logits and every parameter's gradient, fp32.
``benchmarks/family_matrix.py`` runs it over every family of the installed transformers;
``tests/unit/test_family_matrix.py`` checks the verdicts of ``trainer.model.families`` against it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LENGTHS = (9, 1, 14, 5, 11, 3)
"""Longer and shorter than the window, a 1-token example."""
WINDOW = 6
VOCAB = 128
TOLERANCE = 1e-5

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
    """``exact``, ``wrong`` (ran, disagrees), ``error`` (the packed run raised) or ``unbuildable`` (no tiny model)."""
    detail: str = ""
    logit_diff: float = float("nan")
    grad_diff: float = float("nan")

    def line(self) -> str:
        if self.outcome in ("exact", "wrong"):
            return f"{self.family}: {self.outcome} (max |logit diff| {self.logit_diff:.2g}, |grad diff| {self.grad_diff:.2g})"
        return f"{self.family}: {self.outcome}: {self.detail}"


def tiny_config(model_type: str, **overrides):
    """The family's transformers config shrunk to a tiny 2-layer model (``SHRINK``), dropout off."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    fields = set(default.to_dict()) | set(vars(default))
    values = {k: v for k, v in SHRINK.items() if k in fields}
    values.update({k: 0.0 for k in NO_DROPOUT if k in fields})
    layer_types = getattr(default, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and layer_types:
        distinct = list(dict.fromkeys(layer_types))[:2]
        values["layer_types"] = (distinct * 2)[:2]
    return AutoConfig.for_model(model_type, **(values | overrides))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:200]


def _token_loss_sum(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def run_alone(model, examples: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Logits of each example run alone through transformers' own attention, and the summed gradients."""
    model.zero_grad(set_to_none=True)
    logits = []
    for e in examples:
        out = model(input_ids=e[None], position_ids=torch.arange(len(e))[None], attention_mask=torch.ones_like(e)[None])[0]
        _token_loss_sum(out, e).backward()
        logits.append(out.detach())
    return logits, _grads(model)


def run_packed(model, examples: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Logits of each example in one packed row through the packed backend, and the summed gradients."""
    model.zero_grad(set_to_none=True)
    ids = torch.cat(examples)[None]
    cu = torch.tensor([0] + [len(e) for e in examples]).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(len(e)) for e in examples])[None]
    logits = model(input_ids=ids, position_ids=pos, cu_seqlens=cu, max_seqlen=max(len(e) for e in examples))[0]
    pieces = [logits[s:t] for s, t in zip(cu[:-1].tolist(), cu[1:].tolist())]
    sum(_token_loss_sum(p, e) for p, e in zip(pieces, examples)).backward()
    return [p.detach() for p in pieces], _grads(model)


def differences(packed, alone) -> tuple[float, float]:
    """(max |logit diff|, max |grad diff|) between two ``run_*`` results, each relative to max(1, |value|);
    a gradient present in one run only counts as infinite."""
    logit_diff = max(_max_rel_diff(p, a) for p, a in zip(packed[0], alone[0]))
    grad_diff = 0.0
    for name in packed[1].keys() | alone[1].keys():
        if name not in packed[1] or name not in alone[1]:
            return logit_diff, float("inf")
        grad_diff = max(grad_diff, _max_rel_diff(packed[1][name], alone[1][name]))
    return logit_diff, grad_diff


def probe(model_type: str, backend: str = "sdpa_varlen", **overrides) -> ProbeResult:
    """Build a tiny ``model_type`` model as ``build_model`` prepares it and compare packed with one by one."""
    from transformers import AutoModelForCausalLM

    from trainer.model.attention import AttentionNeeds, resolve_backend
    from trainer.model.loading import prepare_model

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = tiny_config(model_type, **overrides)
            torch.manual_seed(0)
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            resolved = resolve_backend(backend, torch.device("cpu"), torch.float32, AttentionNeeds.of(config))
            model = prepare_model(hf, resolved)
    except Exception as e:  # noqa: BLE001 - any failure to build is a verdict of the probe, not of the family
        return ProbeResult(model_type, "unbuildable", _one_line(e))
    g = torch.Generator().manual_seed(1)
    vocab = min(VOCAB, model.model.get_input_embeddings().num_embeddings)
    examples = [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]
    model.train()
    try:
        alone = run_alone(model, examples)
    except Exception as e:  # noqa: BLE001 - transformers' own path fails on the tiny config: no verdict
        return ProbeResult(model_type, "unbuildable", "runs alone: " + _one_line(e))
    try:
        packed = run_packed(model, examples)
    except Exception as e:  # noqa: BLE001 - a family that crashes when packed is refused, with this reason
        return ProbeResult(model_type, "error", _one_line(e))
    logit_diff, grad_diff = differences(packed, alone)
    exact = logit_diff <= TOLERANCE and grad_diff <= TOLERANCE
    return ProbeResult(model_type, "exact" if exact else "wrong", "", logit_diff, grad_diff)


__all__ = ["LENGTHS", "ProbeResult", "differences", "probe", "run_alone", "run_packed", "tiny_config"]
