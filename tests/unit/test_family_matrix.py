"""Every causal-LM family of the installed transformers: exact when packed, or refused at build with one line.

The fast lane checks the table (``trainer.model.families``, the certification's prior) covers the installed
families, that a refused family stops ``build_model`` with one line, and probes a representative few (the
replica stage on a family's default config, ``trainer.model.certification.replica.probe``: packed vs one by
one, logits and every gradient, float64). The slow test probes them all, as
``python benchmarks/family_matrix.py --probe`` does.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import transformers

from trainer.config import ModelConfig
from trainer.model import build_model, families, resolve_backend
from trainer.model.certification import replica
from trainer.model.certification.engine import TOLERANCE
from trainer.model.certification.replica import probe
from trainer.model.certification.stages import prior
from trainer.model.families import TESTED_WITH, FamilyRefusedError, verdict

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "family_matrix.py"
REPRESENTATIVE = [
    "llama",
    "gemma2",  # probed with softcapping off on CPU; flash_attn/flex honour it
    "stablelm",  # its layers drop the boundaries: build_model hands them over (the chunked loss too)
    "llama4_text",  # the chunked loss reads its decoder (`.model`: its base_model is the causal LM)
    "gptj",  # exact on transformers 5.24, refused on 5.17 (bypasses the attention interface there)
    "falcon",  # refused
]
"""Probed in the fast lane with the trainer's step; the verdict each must match is the table's for the
installed transformers."""


def matrix_script():
    spec = importlib.util.spec_from_file_location("family_matrix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installed_families() -> list[str]:
    return matrix_script().causal_lm_families()


def test_the_table_covers_the_installed_families():
    found = {f: verdict(f) for f in installed_families()}
    untested = sorted(f for f, v in found.items() if v.kind == "untested" and not families.text_family(f))
    if transformers.__version__ == TESTED_WITH:  # untested only where the tiny probe cannot build the family
        assert set(untested) == families.NOT_PROBED, "run benchmarks/family_matrix.py --probe and update the table"
    for v in found.values():
        assert v.kind in ("exact", "untested") or (v.reason and "\n" not in v.reason), v
    assert sum(v.kind == "exact" for v in found.values()) >= 80
    assert not families.EXACT & (families.REFUSED.keys() | families.SKIPPED.keys())


@pytest.mark.parametrize("family", ["falcon", "bert", "bart", "deepseek_v32", "git"])
def test_a_refused_family_stops_the_build_with_one_line(family, tokenizer):
    with pytest.raises(FamilyRefusedError) as info:
        build_model(ModelConfig(family=family), tokenizer, resolve_backend("sdpa_varlen", torch.device("cpu")), 0)
    line = str(info.value)
    assert "\n" not in line and repr(family) in line and verdict(family).reason in line


def test_a_window_or_chunk_kept_in_the_mask_is_handed_to_the_layers(monkeypatch):
    """Phi-3.5-MoE (every layer) and Qwen2-MoE (its sliding layers) keep their window in the mask, Llama 4
    its chunks: ``build_model`` hands them to the layers (``trainer.model.layer_relay``), so a window of 6
    and chunks of 8 across the probe's examples are exact; without the relay they are not."""
    from trainer.model import layer_relay

    relayed = {
        "phimoe": {},
        "qwen2_moe": dict(use_sliding_window=True, max_window_layers=1, layer_types=None),
        "llama4_text": dict(attention_chunk_size=8),
    }
    for family, overrides in relayed.items():
        assert prior(transformers.AutoConfig.for_model(family, **overrides)).outcome == "exact"
        result = probe(family, **overrides)
        assert result.outcome == "exact", result.summary()
    monkeypatch.setattr(layer_relay, "WINDOW_DROPPED", frozenset())
    monkeypatch.setattr(layer_relay, "CHUNK_DROPPED", frozenset())
    for family, overrides in relayed.items():
        result = probe(family, **overrides)
        assert result.outcome == "wrong" and result.measurement.logit_diff > 1e-3, result.summary()


def test_a_layer_that_selects_its_keys_is_refused_at_build():
    """An indexer's selection (DSA, MiniMax-M3's block-sparse layers) or a compressor's pooling (DeepSeek-V4)
    is in no packed backend: refused from the config alone, one line naming the layer type and the sizes;
    the same families without such a layer are exact."""
    sparse = transformers.AutoConfig.for_model(
        "minimax_m3_vl_text",
        num_hidden_layers=2,
        layer_types=["minimax_m3_sparse", "full_attention"],
        mlp_layer_types=["dense", "dense"],
        index_block_size=16,
        index_topk_blocks=2,
    )
    with pytest.raises(FamilyRefusedError) as info:
        prior(sparse, self_check=False)
    assert "\n" not in str(info.value)
    assert (
        "'minimax_m3_vl_text' is not certified exact (table prior): its 'minimax_m3_sparse' layers attend to the "
        "key blocks an indexer selects per query (index_block_size=16, index_topk_blocks=2" in str(info.value)
    )
    assert prior(transformers.AutoConfig.for_model("minimax_m3_vl_text")).outcome == "exact"
    with pytest.raises(
        FamilyRefusedError,
        match="'deepseek_v4' .*'heavily_compressed_attention' layers attend to keys a compressor pools",
    ):
        prior(transformers.AutoConfig.for_model("deepseek_v4"))
    sliding = transformers.AutoConfig.for_model(
        "deepseek_v4", num_hidden_layers=2, layer_types=["sliding_attention"] * 2
    )
    assert prior(sliding).outcome == "exact"
    with pytest.raises(FamilyRefusedError, match="'deepseek_v32' .*DSA indexer"):
        prior(transformers.AutoConfig.for_model("deepseek_v32"))
    for family in ("llama4_text", "deepseek_v4", "minimax_m3_vl_text"):
        assert verdict(family).reason, verdict(family)


def test_an_untested_family_trains_only_behind_the_self_check(monkeypatch):
    monkeypatch.setattr(families, "EXACT", families.EXACT - {"llama"})
    config = transformers.AutoConfig.for_model("llama")
    with pytest.raises(
        FamilyRefusedError, match=r"'llama' is not certified exact \(table prior\): untested.*model.self_check=true"
    ):
        prior(config, self_check=False)
    found = prior(config, self_check=True)
    assert found.outcome == "untested" and "untested with packing" in found.detail


@pytest.mark.parametrize("family", REPRESENTATIVE)
def test_representative_families_probe_as_the_table_says(family):
    """The probe runs the trainer's step (default chunked loss, backward, one optimizer step) packed and
    one by one: an exact family is exact on logits and every gradient, before and after the step."""
    if family not in installed_families():  # e.g. dory is newer than transformers 5.17
        pytest.skip(f"{family} is not in transformers {transformers.__version__}")
    result = probe(family)
    if verdict(family).kind == "exact":
        assert result.outcome == "exact", result.summary()
    else:  # what the refusal prevents: a crash or a silently wrong packed run
        assert result.outcome in ("error", "wrong"), result.summary()


def relay_on_the_causal_lm_only(monkeypatch):
    """The relay's hooks on the causal LM only (as before ``decoder_of`` and the per-layer hooks): the chunked
    loss, which calls the decoder directly, bypasses them."""
    monkeypatch.setattr("trainer.model.prepare.decoder_of", lambda model: model)
    monkeypatch.setattr("trainer.model.relay.BoundaryRelay.layer_starts", lambda self, *args: None)


def no_relay(monkeypatch):
    monkeypatch.setattr("trainer.model.prepare.RELAY_BOUNDARIES", frozenset())


@pytest.mark.parametrize("broken", [no_relay, relay_on_the_causal_lm_only])
def test_stablelm_without_the_relay_loses_the_boundaries(monkeypatch, broken):
    """A forward-only probe passes the second case; the trainer's step under the chunked loss does not."""
    broken(monkeypatch)
    result = probe("stablelm")
    assert result.outcome == "wrong" and "without cu_seq_lens_q" in result.detail, result.summary()


def test_the_probe_takes_an_optimizer_step(monkeypatch):
    """A step that leaves non-finite weights makes an exact family wrong: the probe runs the step."""
    monkeypatch.setattr(
        replica, "build_optimizer", lambda model, cfg: torch.optim.SGD(model.parameters(), lr=float("nan"))
    )
    result = probe("llama")
    assert result.outcome == "wrong" and "after one optimizer step" in result.detail, result.summary()


def test_a_family_exact_from_a_newer_transformers_is_refused_on_an_older_one(monkeypatch):
    monkeypatch.setattr(families, "_installed", lambda: "5.17.0")
    found = verdict("gptj")
    assert found.kind == "refused" and "transformers 5.17.0; exact from 5.24" in found.reason
    monkeypatch.setattr(families, "_installed", lambda: "5.24.0")
    assert verdict("gptj").kind == "exact"


KINDS = [
    "qwen3_moe",
    "deepseek_v3",
    "nemotron",
    "gemma4_text",  # exact (MoE, latent attention, relay, float64 rerun)
    "phimoe",
    "gpt_oss",  # exact through the window relay, with attention sinks
    "mamba",
    "qwen3_next",  # exact: state-space scan, gated delta rule (token mixers kept per example)
    "mpt",
    "doge",  # refused (no interface, mask)
    "bart",  # skipped
]
"""A family of every verdict and reason (the slow lane); the whole matrix is the benchmark's ``--probe``."""


def probe_against_the_table(names: list[str]) -> list[str]:
    """What ``benchmarks/family_matrix.py --probe`` flags, plus an untested family wrong by less than the
    self-check would see: an empty list when every family is exact or refused."""
    script = matrix_script()
    bad = []
    for family in names:
        kind = verdict(family).kind
        result = script.probe_isolated(family, timeout_s=180)
        if not script.agrees(kind, result.outcome):
            bad.append(f"{family}: {result.summary()}")
        elif (
            kind == "untested"
            and result.outcome == "wrong"
            and result.measurement is not None
            and result.measurement.logit_diff <= TOLERANCE[torch.float32].logits
        ):
            bad.append(f"{family}: {result.summary()} (the self-check would not see it)")
    return bad


@pytest.mark.slow
def test_a_family_of_every_kind_probes_as_the_table_says():
    assert not probe_against_the_table(KINDS)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("PACKFSDP_FULL_MATRIX"), reason="the whole matrix takes minutes: PACKFSDP_FULL_MATRIX=1"
)
def test_every_family_is_exact_or_refused():
    """Every causal-LM family of the installed transformers, as ``benchmarks/family_matrix.py --probe``."""
    assert not probe_against_the_table(installed_families())


def test_a_family_config_transformers_rejects_is_one_line():
    """transformers' own validation of a family's config (GPT-Neo's layer pattern of another length) fails in
    one ``packfsdp`` line, wherever the config is read (``build_model`` reads it too, not only the CLI)."""
    from trainer.errors import LoadError
    from trainer.model_config import model_config

    with pytest.raises(
        LoadError, match="cannot load model.family=gpt_neo: StrictDataclassClassValidationError"
    ) as info:
        model_config(ModelConfig(family="gpt_neo", random_init=dict(num_layers=2)))
    assert "\n" not in str(info.value)
