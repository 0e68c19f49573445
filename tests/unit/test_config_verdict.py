"""The certification's replica stage: a tiny float64 replica of the user's config, packed vs one by one."""

import os
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import REPO
from trainer.model.certification import Stage, certify_config, replica
from trainer.model.certification.shrink import replica_config
from trainer.model.families import FamilyRefusedError


def replica_of(config) -> Stage:
    """The replica stage of ``config``'s certificate (``certify_config``: the prior, then the replica)."""
    return certify_config(config).stage("replica")


def test_lfm2_conv_layers_bind_in_the_replica_and_are_kept_apart(tmp_path, monkeypatch):
    """LFM2's short convolutions: with the token mixers left as transformers wrote them the replica sees them mix
    examples and names the setting; kept per example (``trainer.model.mixers``) the config is exact."""
    from trainer.model import prepare

    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    config = AutoConfig.for_model("lfm2", layer_types=["conv", "full_attention", "conv", "conv"], num_hidden_layers=4)
    with monkeypatch.context() as patched:
        patched.setattr(prepare, "keep_mixers_apart", lambda *args: [])
        with pytest.raises(FamilyRefusedError, match="'lfm2'.*layer_types contains 'conv'"):
            certify_config(config)
        with pytest.raises(FamilyRefusedError, match="'conv'"):  # the cached verdict refuses the same way
            certify_config(config)
    assert len(list((tmp_path / "verdicts").iterdir())) == 1
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path / "kept"))
    assert replica_of(config).outcome == "exact"


def test_plain_config_is_exact_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    config = AutoConfig.for_model("llama", num_hidden_layers=3)
    first, again = replica_of(config), replica_of(config)
    assert first.outcome == again.outcome == "exact" and not first.cached and again.cached
    assert again.detail == first.detail  # the figures, from the cache


def test_replica_keeps_each_layer_pattern_and_shrinks_windows():
    config = AutoConfig.for_model("lfm2", layer_types=["conv"] * 10 + ["full_attention"] * 6, num_hidden_layers=16)
    replica = replica_config(config)
    assert sorted(set(replica.layer_types)) == ["conv", "full_attention"] and replica.num_hidden_layers <= 6
    qwen = replica_config(AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=4096))
    assert qwen.sliding_window < 21  # crossed by the replica's longest example


def test_chunked_loss_keeps_the_boundary_relay():
    """stablelm drops the boundaries in its layers; the chunked loss must go through the relay too."""
    from trainer.model.attention import resolve_backend
    from trainer.model.prepare import prepare_model

    config = AutoConfig.for_model(
        "stablelm",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    torch.manual_seed(0)
    model = prepare_model(AutoModelForCausalLM.from_config(config), resolve_backend("sdpa_varlen", torch.device("cpu")))
    model.use_loss("chunked")
    ids = torch.randint(3, 64, (1, 12))
    loss = model.token_loss(
        ids, torch.tensor([list(range(5)) + list(range(7))]), torch.tensor([0, 5, 12], dtype=torch.int32), 7, labels=ids
    )
    assert torch.isfinite(loss)


def test_a_window_kept_only_in_the_mask_is_relayed_and_exact(tmp_path, monkeypatch):
    """qwen2_moe with sliding layers: its attention never passes the window on; ``build_model`` hands it to
    the sliding layers (``trainer.model.layer_relay``), so the verdict finds it exact (float32: MoE kernels),
    and refuses it naming the setting where the relay is off."""
    from trainer.model import layer_relay

    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    config = AutoConfig.for_model(
        "qwen2_moe",
        use_sliding_window=True,
        sliding_window=4096,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
    )
    assert replica_of(config).outcome == "exact"
    monkeypatch.setattr(layer_relay, "WINDOW_DROPPED", frozenset())
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path / "relay_off"))
    with pytest.raises(
        FamilyRefusedError,
        match=r"'qwen2_moe' is not certified exact \(replica\): .*sliding_attention.*sliding_window=4096",
    ):
        certify_config(config)


def _binding_sizes(config) -> dict[str, int]:
    """The window / chunk / selection sizes of ``config`` that bind (shorter than its context)."""
    from trainer.model.certification.shrink import SMALL

    values = config.to_dict()
    context = values.get("max_position_embeddings") or values.get("n_positions") or 10**9
    sizes = {k: values[k] for k in SMALL if isinstance(values.get(k), int) and not isinstance(values.get(k), bool)}
    if "index_block_size" in sizes and isinstance(values.get("index_topk_blocks"), int):
        sizes["selected keys"] = values["index_block_size"] * values["index_topk_blocks"]
    return {k: v for k, v in sizes.items() if 0 < v < context}


def test_every_binding_window_chunk_and_selection_binds_in_the_replica():
    """For every causal-LM family of the installed transformers, at its default config and with a window,
    chunks or a sparse layer as users set them: each size that binds for the user (shorter than the context)
    binds in the replica too (shorter than its longest example), so the verdict never passes a config whose
    setting it did not exercise."""
    import warnings

    from tests.unit.test_family_matrix import installed_families
    from trainer.model.certification.replica import LENGTHS

    users = [(f, {}) for f in installed_families()] + [
        ("llama4_text", dict(attention_chunk_size=16, floor_scale=32)),
        (
            "minimax_m3_vl_text",
            dict(
                num_hidden_layers=2,
                layer_types=["minimax_m3_sparse", "full_attention"],
                mlp_layer_types=["dense", "dense"],
                index_block_size=16,
                index_topk_blocks=2,
            ),
        ),
        ("deepseek_v32", dict(index_topk=64)),
    ]
    checked = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family, overrides in users:
            try:
                config = AutoConfig.for_model(family, **overrides)
                replica = replica_config(config)
            except Exception:  # noqa: BLE001 - a config transformers cannot build bare (dbrx): no replica either
                continue
            got = _binding_sizes(replica)
            for name, size in _binding_sizes(config).items():
                assert name in got and got[name] < max(LENGTHS), (family, name, size, got.get(name))
                checked.add(name)
    assert {"sliding_window", "attention_chunk_size", "floor_scale", "index_topk", "selected keys"} <= checked


def test_a_block_sparse_layer_is_refused_by_the_verdict_too(tmp_path, monkeypatch):
    """MiniMax-M3's indexer-selected layer, which the family table refuses at build: the replica on its own
    refuses it too (its replica's selection, 4 x 2 keys, binds), naming the layer type."""
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    config = AutoConfig.for_model(
        "minimax_m3_vl_text",
        num_hidden_layers=2,
        layer_types=["minimax_m3_sparse", "full_attention"],
        mlp_layer_types=["dense", "dense"],
        index_block_size=16,
        index_topk_blocks=2,
    )
    found = replica.judge(config)
    assert found.outcome in ("refused", "wrong") and "block_indices" in found.detail and "\n" not in found.detail


def test_the_initial_weights_do_not_depend_on_the_verdict_cache(tmp_path, monkeypatch, tokenizer):
    """Every rank must build the same random init: a rank whose verdict was computed (the replica draws
    random numbers) and one that read it from the cache get identical weights."""
    from trainer.config import ModelConfig
    from trainer.model import build_model, resolve_backend

    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    cfg = ModelConfig(
        family="llama",
        config_overrides=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        ),
    )
    backend = resolve_backend("sdpa_varlen", torch.device("cpu"))
    cold = build_model(cfg, tokenizer, backend, seed=3).state_dict()  # verdict computed
    warm = build_model(cfg, tokenizer, backend, seed=3).state_dict()  # verdict cached
    assert len(list((tmp_path / "verdicts").iterdir())) == 1
    for name, tensor in cold.items():
        torch.testing.assert_close(warm[name], tensor, rtol=0, atol=0, msg=name)


def test_only_rank_0_judges_and_every_rank_follows_its_verdict(tmp_path, monkeypatch):
    """On a cache miss rank 0 builds the replica; another rank never does, and takes rank 0's verdict."""
    from trainer import distributed

    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    monkeypatch.setattr(distributed, "is_rank0", lambda: False)
    sent = iter([None, Stage("replica", "refused", "rank 0's line")])  # rank 0's error (none), then its verdict
    monkeypatch.setattr(distributed, "broadcast_object", lambda obj, src=0: next(sent))
    monkeypatch.setattr(replica, "judge", lambda *a: pytest.fail("a rank other than 0 judged the config"))
    with pytest.raises(FamilyRefusedError, match="rank 0's line"):
        certify_config(AutoConfig.for_model("llama", num_hidden_layers=2))
    assert not (tmp_path / "verdicts").exists()


def test_a_window_that_never_binds_stays_unbound_in_the_replica():
    """A window as long as the context never binds: the replica must not shrink it into one that does."""
    from trainer.model.certification.shrink import CONTEXT

    unbound = replica_config(AutoConfig.for_model("mistral", sliding_window=4096, max_position_embeddings=4096))
    assert unbound.sliding_window >= CONTEXT == unbound.max_position_embeddings


def test_gemma3n_nan_gradients_on_the_pad_token_are_refused(tmp_path, monkeypatch):
    """Gemma 3n's AltUp takes sqrt(mean(h^2)) of each token's embedding: for the pad token (an all-zero
    padding_idx row) its gradient is NaN, packed and padded alike. Refused in one line naming it."""
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    config = AutoConfig.for_model(
        "gemma3n_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_kv_shared_layers=0,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size=512,
        pad_token_id=0,
    )
    with pytest.raises(
        FamilyRefusedError, match="'gemma3n_text' is not certified exact .*not finite.*pad_token_id=0"
    ) as info:
        certify_config(config)
    assert "\n" not in str(info.value)


def test_lfm2_moe_with_conv_layers_builds_from_a_local_checkpoint_config(tmp_path, monkeypatch, tokenizer):
    """``model.name_or_path`` at a local config with short-convolution layers: judged exact, built, its
    convolutions kept per example."""
    from trainer.config import ModelConfig
    from trainer.model import build_model, resolve_backend
    from trainer.model.mixers import PackedMixerForward

    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path / "cache"))
    config = AutoConfig.for_model(
        "lfm2_moe",
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        num_dense_layers=1,
        layer_types=["conv", "full_attention"],
        vocab_size=256,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "lfm2_moe")
    model = build_model(
        ModelConfig(name_or_path=str(tmp_path / "lfm2_moe")),
        tokenizer,
        resolve_backend("sdpa_varlen", torch.device("cpu")),
        0,
    )
    kept = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), PackedMixerForward)]
    assert [type(m).__name__ for m in kept] == ["Lfm2MoeShortConv"]


MLA_FAMILIES = ["deepseek_v3", "deepseek_v2", "glm4_moe_lite", "minicpm3", "youtu", "axk1", "sarvam_mla"]
"""Multi-head latent attention: transformers' attention runs it only with as many KV heads as heads."""


def installed(family: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return family in CONFIG_MAPPING_NAMES


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_mla_released_configs_are_judged_exact(family):
    """The replica keeps KV heads = heads and MLA's head dims (head_dim is the rope head dim); it used to
    force 4 heads / 2 KV heads, which MLA cannot run, and refused every MLA family ("the tiny replica fails")."""
    if not installed(family):
        pytest.skip(f"{family} is not in this transformers")
    config = AutoConfig.for_model(family)
    tiny = replica_config(config)
    assert tiny.num_key_value_heads == tiny.num_attention_heads == 4
    assert getattr(tiny, "head_dim", tiny.qk_rope_head_dim) == tiny.qk_rope_head_dim
    assert tiny.q_lora_rank is None if config.q_lora_rank is None else tiny.q_lora_rank <= config.q_lora_rank
    assert replica.judge(config).outcome == "exact"


def test_replica_shapes_keep_the_config_s_own_constraints():
    """Head counts keep their ratios (a KV head count divides the heads), a size never grows past the config's
    (one expert per token stays one), per-layer lists of layer ids follow the kept layers."""
    from trainer.model.certification.shrink import shrunk_layers, shrunk_shapes

    shapes = shrunk_shapes(
        {
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "num_experts": 16,
            "num_experts_per_tok": 1,
            "q_lora_rank": None,
            "pad_token_id": None,
            "head_dim": 64,
        }
    )
    assert shapes == {
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "num_experts": 4,
        "num_experts_per_tok": 1,
        "head_dim": 16,
    }
    layers = shrunk_layers(
        {
            "num_hidden_layers": 8,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 4,
            "kv_source_layers": [0, 1, 2, 3, 4, 5, 1, 3],
            "hybrid_layer_ids": [3, 6],
        },
        most=2,
    )
    kept = layers["num_hidden_layers"]
    assert set(layers["layer_types"]) == {"sliding_attention", "full_attention"} and kept == len(layers["layer_types"])
    sources = layers["kv_source_layers"]
    assert all(sources[sources[i]] == sources[i] <= i for i in range(kept))  # every layer reads a kept producer
    assert all(0 <= i < kept for i in layers["hybrid_layer_ids"])


def test_gpt2_upcast_attention_is_judged_in_float32():
    """GPT-2's ``reorder_and_upcast_attn`` asserts float32 attention weights: the float64 replica cannot run,
    the float32 one is exact (~2e-7); it used to be refused as "the tiny replica fails"."""
    found = replica.judge(AutoConfig.for_model("gpt2", reorder_and_upcast_attn=True))
    assert found.outcome == "exact" and found.detail.startswith("float32 ") and "(float64 fails: " in found.detail


def with_nan_gradient(side: str, monkeypatch) -> None:
    """The replica's gradient digest of one side (``packed``: the first taken; ``alone``: the second) with its
    first gradient by name NaN: a fault injected on one side."""
    from trainer.model.certification import engine

    real, calls = engine.gradient_digest, []

    def digest(model, full):
        found = real(model, full)
        calls.append(1)
        if len(calls) == (1 if side == "packed" else 2):
            first = min(found)
            found[first] = found[first] * float("nan")
        return found

    monkeypatch.setattr(engine, "gradient_digest", digest)


@pytest.mark.parametrize("side", ["alone", "packed"])
def test_a_nan_is_reported_as_a_nan_with_its_side(side, monkeypatch):
    """A NaN never reads as examples that mix: the line says which side (the examples alone: the model's
    own; packed) and what (the logits, which parameter's gradient)."""
    with_nan_gradient(side, monkeypatch)
    found = replica.judge(AutoConfig.for_model("llama", num_hidden_layers=2))
    line = found.detail
    assert found.outcome in ("refused", "wrong") and "mix" not in line and "\n" not in line
    if side == "alone":
        assert "the gradient of model.lm_head.weight is not finite (NaN) with its examples run one by one" in line
        assert "the model's own computation, not packing's" in line
    else:
        assert "packed, the gradient of model.lm_head.weight is not finite (NaN) where its examples" in line


@pytest.mark.skipif(not installed("dory"), reason="dory is newer than this transformers")
def test_dory_with_a_pad_token_is_refused_as_its_own_nan():
    """Dory (nGPT) keeps every hidden state on the unit sphere: a sequence that starts with a zero embedding
    (the pad's padding_idx row) stays zero through every layer, and each L2 norm at zero multiplies the
    backward by 1/sqrt(eps): NaN gradients, alone and packed alike (transformers' own model, every
    attention implementation). It was stopped by the self-check as "examples are not kept apart"."""
    config = AutoConfig.for_model(
        "dory",
        num_hidden_layers=4,
        n_input_layers=1,
        n_recurrent_layers=2,
        n_output_layers=1,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=16,
    )
    assert replica.judge(config).outcome == "exact"  # no pad token: nothing to refuse
    config.pad_token_id = 0
    found = replica.judge(config)
    assert found.outcome == "refused" and "the model's own computation, not packing's" in found.detail
    assert "pad_token_id=0" in found.detail


def test_a_replica_that_fails_falls_back_and_never_refuses(monkeypatch):
    """A replica that cannot run is no verdict on the user's model: the larger replica (the config's own
    widths) judges it; where none runs, the stage says why, and the startup self-check decides."""
    real = replica.replica_config

    def broken(config, own_shapes=False):
        replica = real(config, own_shapes)
        if not own_shapes:
            replica.num_key_value_heads = 3  # 4 heads in 3 KV heads: the tiny replica cannot run
        return replica

    config = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
    )
    monkeypatch.setattr(replica, "replica_config", broken)
    assert replica.judge(config).outcome == "exact"
    monkeypatch.setattr(replica, "REPLICA_MAX_PARAMETERS", 1000)  # the larger replica too big to run
    found = replica.judge(config)
    assert found.outcome == "unbuildable" and "\n" not in found.detail
    assert "tiny replica: RuntimeError" in found.detail and "parameters, over 1,000" in found.detail


QWEN2_TINY = yaml.safe_load((REPO / "configs" / "model" / "qwen2_tiny.yaml").read_text())["random_init"]
FORMERLY_REFUSED = {
    "deepseek_v3": {"num_key_value_heads": 4},  # MLA: KV heads = heads
    "glm4_moe_lite": {"num_key_value_heads": 4},
    "minicpm3": {"num_key_value_heads": 4},
    "gpt2": {"reorder_and_upcast_attn": True},  # float32 attention weights only
}
"""``model=qwen2_tiny model.family=F model.config_overrides=...`` configs the verdict refused falsely."""


def packed_vs_alone(config, dtype: torch.dtype) -> tuple[float, float]:
    """(max relative |logit diff|, max relative |grad diff|) of 4 examples in one packed row through
    ``sdpa_varlen`` against each alone through transformers' eager attention: per-token cross-entropy summed,
    every parameter's gradient. Written here, apart from the verdict's replica and the family probe."""
    from transformers import AutoModelForCausalLM

    from trainer.model.attention import AttentionNeeds, resolve_backend
    from trainer.model.prepare import prepare_model

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(
        config, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )
    model = prepare_model(hf, resolve_backend("sdpa_varlen", torch.device("cpu"), dtype, AttentionNeeds.of(config)))
    model.padded_attention = "eager"
    model.eval()
    examples = [
        torch.randint(3, config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (13, 1, 7, 20)
    ]

    def loss(logits, ids):
        return torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum")

    alone_logits = []
    for ids in examples:
        logits = model(ids[None], torch.arange(len(ids))[None], attention_mask=torch.ones_like(ids)[None])[0]
        loss(logits, ids).backward()
        alone_logits.append(logits.detach())
    alone_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    cu = torch.tensor([0, *torch.tensor([len(e) for e in examples]).cumsum(0).tolist()], dtype=torch.int32)
    packed = model(
        torch.cat(examples)[None],
        torch.cat([torch.arange(len(e)) for e in examples])[None],
        cu,
        max(len(e) for e in examples),
    )[0]
    sum(loss(packed[s:t], ids) for s, t, ids in zip(cu[:-1], cu[1:], examples, strict=False)).backward()

    def rel(a, b) -> float:
        return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))

    logit_diff = max(rel(packed[s:t].detach(), a) for s, t, a in zip(cu[:-1], cu[1:], alone_logits, strict=False))
    grad_diff = max(rel(p.grad, alone_grads[n]) for n, p in model.named_parameters() if p.grad is not None)
    return logit_diff, grad_diff


@pytest.mark.parametrize("family", FORMERLY_REFUSED)
def test_formerly_refused_configs_are_exact_packed(family, tmp_path, monkeypatch):
    """The verdict now says exact, and an independent packed-vs-alone run agrees: float64 (GPT-2's upcast
    attention runs in float32 only: 2e-5 there)."""
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    config = AutoConfig.for_model(family, **(QWEN2_TINY | FORMERLY_REFUSED[family]), vocab_size=256, pad_token_id=0)
    assert replica_of(config).outcome == "exact"
    if getattr(config, "n_routed_experts", None):  # fewer, narrower experts than the CLI run's (seconds, not 20)
        config.n_routed_experts, config.moe_intermediate_size = 4, 32
    # eager attention takes its softmax in float32 (~1e-7 in a float64 model); a leak gives 1e-4 and more
    dtype, tolerance = (torch.float32, 2e-5) if family == "gpt2" else (torch.float64, 1e-6)
    logit_diff, grad_diff = packed_vs_alone(config, dtype)
    assert logit_diff <= tolerance and grad_diff <= tolerance, (logit_diff, grad_diff)


@pytest.mark.slow
def test_formerly_refused_configs_train_with_the_self_check(tmp_path):
    """``python -m trainer.train model=qwen2_tiny model.family=F model.config_overrides=...`` trains (rc 0, the
    self-check on) for each family of ``FORMERLY_REFUSED``: one Hydra multirun, their overrides together
    (each config ignores the others' field)."""
    overrides = ",".join(f"{k}:{str(v).lower()}" for f in FORMERLY_REFUSED.values() for k, v in f.items())
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PACKFSDP_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.train",
            "-m",
            "model=qwen2_tiny",
            f"model.family={','.join(FORMERLY_REFUSED)}",
            f"model.config_overrides={{{overrides}}}",
            "data.num_records=400",
            "max_steps=2",
            "logger.peak_tflops=1",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    for family in FORMERLY_REFUSED:
        assert f"certified exact: {family} (table prior; replica float" in log, family
    assert log.count("; self-check packed micro-batch") == len(FORMERLY_REFUSED)


def test_no_replica_and_no_self_check_is_refused(tmp_path, monkeypatch):
    """Without a verdict from a replica, only the startup self-check vouches for the config: turning it off
    refuses the config in one line instead of training it unchecked."""
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    monkeypatch.setattr(replica, "judge", lambda config: Stage("replica", "unbuildable", "no replica runs (...)"))
    config = AutoConfig.for_model("llama", num_hidden_layers=2)
    assert replica_of(config).outcome == "unbuildable"
    with pytest.raises(
        FamilyRefusedError,
        match=r"'llama' is not certified exact \(replica\): no replica .* keep model.self_check=true",
    ):
        certify_config(config, self_check=False)
