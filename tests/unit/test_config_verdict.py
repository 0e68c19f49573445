"""The config verdict: a tiny float64 replica of the user's config, packed vs one by one."""

import pytest
import torch
from transformers import AutoConfig

from trainer.model.config_verdict import replica_config, verify_config
from trainer.model.families import FamilyRefusedError


def test_lfm2_conv_layers_are_refused_naming_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    config = AutoConfig.for_model("lfm2", layer_types=["conv", "full_attention", "conv", "conv"], num_hidden_layers=4)
    with pytest.raises(FamilyRefusedError, match="'lfm2'.*layer_types contains 'conv'"):
        verify_config(config)
    with pytest.raises(FamilyRefusedError, match="'conv'"):  # the cached verdict refuses the same way
        verify_config(config)
    assert len(list((tmp_path / "verdicts").iterdir())) == 1


def test_plain_config_is_exact_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    config = AutoConfig.for_model("llama", num_hidden_layers=3)
    assert verify_config(config) == "exact"
    assert verify_config(config) == "cached:exact"


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
    from transformers import AutoModelForCausalLM

    config = AutoConfig.for_model("stablelm", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    model = prepare_model(AutoModelForCausalLM.from_config(config), resolve_backend("sdpa_varlen", torch.device("cpu")))
    model.use_loss("chunked")
    ids = torch.randint(3, 64, (1, 12))
    loss = model.token_loss(ids, torch.tensor([list(range(5)) + list(range(7))]), torch.tensor([0, 5, 12], dtype=torch.int32),
                            7, labels=ids)
    assert torch.isfinite(loss)


def test_a_window_kept_only_in_the_mask_is_relayed_and_exact(tmp_path, monkeypatch):
    """qwen2_moe with sliding layers: its attention never passes the window on; ``build_model`` hands it to
    the sliding layers (``trainer.model.layer_relay``), so the verdict finds it exact (float32: MoE kernels),
    and refuses it naming the setting where the relay is off."""
    from trainer.model import layer_relay

    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    config = AutoConfig.for_model("qwen2_moe", use_sliding_window=True, sliding_window=4096, num_hidden_layers=2,
                                  layer_types=["sliding_attention", "full_attention"])
    assert verify_config(config) == "exact"
    monkeypatch.setattr(layer_relay, "WINDOW_DROPPED", frozenset())
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path / "relay_off"))
    with pytest.raises(FamilyRefusedError, match="'qwen2_moe'.*sliding_attention.*sliding_window=4096"):
        verify_config(config)


def _binding_sizes(config) -> dict[str, int]:
    """The window / chunk / selection sizes of ``config`` that bind (shorter than its context)."""
    from trainer.model.config_verdict import SMALL

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

    from trainer.model.config_verdict import LENGTHS
    from tests.unit.test_family_matrix import installed_families

    users = [(f, {}) for f in installed_families()] + [
        ("llama4_text", dict(attention_chunk_size=16, floor_scale=32)),
        ("minimax_m3_vl_text", dict(num_hidden_layers=2, layer_types=["minimax_m3_sparse", "full_attention"],
                                    mlp_layer_types=["dense", "dense"], index_block_size=16, index_topk_blocks=2)),
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
    """MiniMax-M3's indexer-selected layer, which the family table refuses at build: the verdict on its own
    refuses it too (its replica's selection, 4 x 2 keys, binds), naming the layer type."""
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    config = AutoConfig.for_model(
        "minimax_m3_vl_text", num_hidden_layers=2, layer_types=["minimax_m3_sparse", "full_attention"],
        mlp_layer_types=["dense", "dense"], index_block_size=16, index_topk_blocks=2,
    )
    with pytest.raises(FamilyRefusedError, match="'minimax_m3_vl_text'.*block_indices") as info:
        verify_config(config)
    assert "\n" not in str(info.value)


def test_the_initial_weights_do_not_depend_on_the_verdict_cache(tmp_path, monkeypatch, tokenizer):
    """Every rank must build the same random init: a rank whose verdict was computed (the replica draws
    random numbers) and one that read it from the cache get identical weights."""
    from trainer.config import ModelConfig
    from trainer.model import build_model, resolve_backend

    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    cfg = ModelConfig(family="llama", config_overrides=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                            num_attention_heads=4, num_key_value_heads=2))
    backend = resolve_backend("sdpa_varlen", torch.device("cpu"))
    cold = build_model(cfg, tokenizer, backend, seed=3).state_dict()  # verdict computed
    warm = build_model(cfg, tokenizer, backend, seed=3).state_dict()  # verdict cached
    assert len(list((tmp_path / "verdicts").iterdir())) == 1
    for name, tensor in cold.items():
        torch.testing.assert_close(warm[name], tensor, rtol=0, atol=0, msg=name)


def test_only_rank_0_judges_and_every_rank_follows_its_verdict(tmp_path, monkeypatch):
    """On a cache miss rank 0 builds the replica; another rank never does, and takes rank 0's verdict."""
    from trainer import distributed
    from trainer.model import config_verdict

    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    monkeypatch.setattr(distributed, "is_rank0", lambda: False)
    sent = iter([None, ("refused", "rank 0's line")])  # rank 0's error (none), then its verdict
    monkeypatch.setattr(distributed, "broadcast_object", lambda obj, src=0: next(sent))
    monkeypatch.setattr(config_verdict, "_judge", lambda *a: pytest.fail("a rank other than 0 judged the config"))
    with pytest.raises(FamilyRefusedError, match="rank 0's line"):
        verify_config(AutoConfig.for_model("llama", num_hidden_layers=2))
    assert not (tmp_path / "verdicts").exists()


def test_a_window_that_never_binds_stays_unbound_in_the_replica():
    """A window as long as the context never binds: the replica must not shrink it into one that does."""
    from trainer.model.config_verdict import CONTEXT

    unbound = replica_config(AutoConfig.for_model("mistral", sliding_window=4096, max_position_embeddings=4096))
    assert unbound.sliding_window >= CONTEXT == unbound.max_position_embeddings


def test_gemma3n_nan_gradients_on_the_pad_token_are_refused(tmp_path, monkeypatch):
    """Gemma 3n's AltUp takes sqrt(mean(h^2)) of each token's embedding: for the pad token (an all-zero
    padding_idx row) its gradient is NaN, packed and padded alike. Refused in one line naming it."""
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    config = AutoConfig.for_model(
        "gemma3n_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"],
        vocab_size=512, pad_token_id=0,
    )
    with pytest.raises(FamilyRefusedError, match="'gemma3n_text'.*not finite.*pad_token_id=0") as info:
        verify_config(config)
    assert "\n" not in str(info.value)


def test_lfm2_moe_with_conv_layers_is_refused_from_a_local_checkpoint_config(tmp_path, monkeypatch, tokenizer):
    """``model.name_or_path`` at a local config (no weights needed: refused before loading them)."""
    from trainer.config import ModelConfig
    from trainer.model import build_model, resolve_backend

    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path / "cache"))
    AutoConfig.for_model(
        "lfm2_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
        layer_types=["conv", "full_attention"], vocab_size=256,
    ).save_pretrained(tmp_path / "lfm2_moe")
    with pytest.raises(FamilyRefusedError, match="'lfm2_moe'.*layer_types contains 'conv'"):
        build_model(ModelConfig(name_or_path=str(tmp_path / "lfm2_moe")), tokenizer,
                    resolve_backend("sdpa_varlen", torch.device("cpu")), 0)
