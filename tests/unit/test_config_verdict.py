"""The config verdict: a tiny float64 replica of the user's config, packed vs one by one."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trainer.model.config_verdict import replica_config, verify_config
from trainer.model.families import FamilyRefusedError


def test_lfm2_conv_layers_bind_in_the_replica_and_are_kept_apart(tmp_path, monkeypatch):
    """LFM2's short convolutions: with the token mixers left as transformers wrote them the replica sees them mix
    examples and names the setting; kept per example (``trainer.model.mixers``) the config is exact."""
    from trainer.model import prepare

    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    config = AutoConfig.for_model("lfm2", layer_types=["conv", "full_attention", "conv", "conv"], num_hidden_layers=4)
    with monkeypatch.context() as patched:
        patched.setattr(prepare, "keep_mixers_apart", lambda *args: [])
        with pytest.raises(FamilyRefusedError, match="'lfm2'.*layer_types contains 'conv'"):
            verify_config(config)
        with pytest.raises(FamilyRefusedError, match="'conv'"):  # the cached verdict refuses the same way
            verify_config(config)
    assert len(list((tmp_path / "verdicts").iterdir())) == 1
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path / "kept"))
    assert verify_config(config) == "exact"


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

    config = AutoConfig.for_model("stablelm", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    model = prepare_model(AutoModelForCausalLM.from_config(config), resolve_backend("sdpa_varlen", torch.device("cpu")))
    model.use_loss("chunked")
    ids = torch.randint(3, 64, (1, 12))
    loss = model(ids, torch.tensor([list(range(5)) + list(range(7))]), torch.tensor([0, 5, 12], dtype=torch.int32), 7,
                 labels=ids)
    assert torch.isfinite(loss)


def test_window_kept_only_in_the_mask_is_refused(tmp_path, monkeypatch):
    """qwen2_moe with sliding layers: the window never reaches the attention function (float32: MoE kernels)."""
    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path))
    config = AutoConfig.for_model("qwen2_moe", use_sliding_window=True, sliding_window=4096, num_hidden_layers=2,
                                  layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(FamilyRefusedError, match="'qwen2_moe'.*sliding_attention.*sliding_window=4096"):
        verify_config(config)


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


def test_lfm2_moe_with_conv_layers_builds_from_a_local_checkpoint_config(tmp_path, monkeypatch, tokenizer):
    """``model.name_or_path`` at a local config with short-convolution layers: judged exact, built, its
    convolutions kept per example."""
    from trainer.config import ModelConfig
    from trainer.model import build_model, resolve_backend
    from trainer.model.mixers import PackedMixerForward

    monkeypatch.setenv("PACKFSDP_CACHE", str(tmp_path / "cache"))
    config = AutoConfig.for_model(
        "lfm2_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
        layer_types=["conv", "full_attention"], vocab_size=256,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "lfm2_moe")
    model = build_model(ModelConfig(name_or_path=str(tmp_path / "lfm2_moe")), tokenizer,
                        resolve_backend("sdpa_varlen", torch.device("cpu")), 0)
    kept = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), PackedMixerForward)]
    assert [type(m).__name__ for m in kept] == ["Lfm2MoeShortConv"]
