"""Your model as it is: a local folder loads with its own family, sizes, tokenizer and context (no preset
leaks into it), and a library's failure reaches the user as one line with the library's own words."""

from __future__ import annotations

import logging

import pytest

from tests.conftest import compose_job
from trainer.config import ConfigError, ModelConfig
from trainer.errors import LoadError
from trainer.library_log import library_load
from trainer.model.loading import model_config


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, tokenizer):
    """A tiny Llama saved with save_pretrained, with the tokenizer it was made for."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_folder_under_the_default_preset_gets_none_of_its_sizes(llama_folder):
    job = compose_job([f"model.name_or_path={llama_folder}"])  # the default group is gpt2_tiny
    assert job.model.random_init["n_layer"] == 2  # the preset's sizes are there ...
    assert job.model.init_fields() == {}  # ... but never reach a loaded model
    assert job.model.tokenizer_name() == str(llama_folder)  # local_bpe means "the folder's own" here
    config = model_config(job.model)
    assert config.model_type == "llama" and config.num_hidden_layers == 2 and not hasattr(config, "n_layer")
    job.validate_budget(256)  # the folder states the context; nothing else needed


def test_model_hf_reads_everything_from_the_folder_and_overrides_are_explicit(llama_folder):
    job = compose_job(
        ["model=hf", f"model.name_or_path={llama_folder}", "model.config_overrides.max_position_embeddings=128"]
    )
    assert job.model.random_init == {} and job.model.tokenizer_name() == str(llama_folder)
    assert model_config(job.model).max_position_embeddings == 128  # asked for by name: applied
    random = ModelConfig(family="gpt2", random_init={"n_layer": 2}, config_overrides={"n_layer": 3})
    assert random.init_fields() == {"n_layer": 3}  # on a built model, your overrides win over the preset


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model=hf"], "model.name_or_path must be set"),
        (["model=hf", "model.name_or_path=/no/such/model"], "model.name_or_path=/no/such/model: no such folder"),
    ],
)
def test_model_hf_without_a_usable_folder_is_one_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_job(overrides)


def test_a_broken_folder_fails_with_the_library_message(llama_folder, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(LoadError, match=rf"cannot load model.name_or_path={broken}: OSError: .*not a valid JSON file"):
        model_config(ModelConfig(name_or_path=str(broken)))


def test_library_load_relays_warnings_and_keeps_our_own_errors(caplog):
    lib = logging.getLogger("transformers")
    before = (lib.level, lib.handlers[:])
    with caplog.at_level(logging.WARNING), library_load("the thing"):
        logging.getLogger("transformers.modeling_utils").warning("Some weights were newly initialized: lm_head")
    assert "the thing says: Some weights were newly initialized: lm_head" in caplog.text
    with pytest.raises(ConfigError, match="^ours$") as info, library_load("the thing"):
        raise ConfigError("ours")
    assert not isinstance(info.value, LoadError)
    with pytest.raises(LoadError, match=r"^cannot load the thing: KeyError: 'x'$"), library_load("the thing"):
        raise KeyError("x")
    assert (lib.level, lib.handlers) == before  # the library's logging is left as it was


def test_config_overrides_take_any_key_one_by_one_or_as_a_mapping():
    """A key the preset does not set, or a whole mapping: no ``+``/``++`` for the user to know about."""
    assert compose_job(["model.config_overrides.n_inner=64"]).model.init_fields()["n_inner"] == 64
    whole = compose_job(["model.config_overrides={n_layer:3,n_inner:64}"]).model
    assert whole.config_overrides == {"n_layer": 3, "n_inner": 64} and whole.init_fields()["n_layer"] == 3
    assert compose_job(["model.random_init.n_layer=1"]).model.init_fields()["n_layer"] == 1
