"""Multimodal checkpoints fine-tuned on text (``trainer.model.multimodal``): a tiny Gemma3ForConditionalGeneration
folder (saved here from a tiny config, with the local tokenizer) trains its language model as ``gemma3_text``,
its vision tower and projector left out of the step, and exports back to the same architecture: the vision
weights bit for bit, the language model's trained weights under the folder's own names. Images in the data are
refused in one line; a folder transformers cannot load as a causal LM is refused in one line, no traceback."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForImageTextToText

from tests.data_oracle import render_records
from trainer.checkpoint import Checkpointer, TrainingState
from trainer.config import CheckpointConfig, ConfigError, DataConfig, ModelConfig, OptimConfig, PeftConfig
from trainer.data import load_records
from trainer.data.bad_records import BadRecordError
from trainer.data.tables import rows_to_records
from trainer.model import build_model, families, resolve_backend
from trainer.model.certification import certify_config
from trainer.model.families import FamilyRefusedError, verdict
from trainer.model.lora import apply_peft
from trainer.model.multimodal import FROZEN_WEIGHTS, MULTIMODAL_DIR, MultimodalError, split
from trainer.model_config import folder_config, model_config
from trainer.optim import build_optimizer
from trainer.tools.export import export

PREPROCESSOR = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 32, "width": 32}}
TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
)


def tiny_folder(path, tokenizer, model_type: str, **config):
    """A tiny multimodal model of ``model_type`` saved with ``save_pretrained`` (seeded), with the tokenizer."""
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type, **config)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_gemma3(folder, tokenizer):
    """A tiny Gemma3ForConditionalGeneration (SigLIP tower, projector, 2-layer text model with a sliding
    window) with the tokenizer and a processor config."""
    vocab = 4096
    tiny_folder(
        folder,
        tokenizer,
        "gemma3",
        text_config=dict(model_type="gemma3_text", vocab_size=vocab, sliding_window=16, **TEXT),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        mm_tokens_per_image=4,
        boi_token_index=vocab - 3,
        eoi_token_index=vocab - 2,
        image_token_index=vocab - 1,
    )
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return folder


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory, tokenizer):
    return tiny_gemma3(tmp_path_factory.mktemp("models") / "tiny-gemma3", tokenizer)


def built(folder, tokenizer, **model):
    return build_model(
        ModelConfig(name_or_path=str(folder), **model),
        tokenizer,
        resolve_backend("sdpa_varlen", torch.device("cpu")),
        0,
    )


def test_the_folder_is_judged_and_sized_by_its_language_model(gemma3_folder):
    cfg = ModelConfig(name_or_path=str(gemma3_folder), config_overrides={"max_position_embeddings": 128})
    config = model_config(cfg)
    assert config.model_type == "gemma3_text" and config.max_position_embeddings == 128  # your override reaches it
    whole = folder_config(cfg)
    assert whole.model_type == "gemma3" and whole.text_config.max_position_embeddings == 128
    assert certify_config(whole).family == "gemma3_text"  # a multimodal config is judged by its language model
    assert verdict("gemma3").kind == "exact" and "gemma3_text" in verdict("gemma3").reason


def test_the_language_model_is_the_multimodal_models_own_modules(gemma3_folder):
    whole = AutoModelForImageTextToText.from_pretrained(gemma3_folder)
    model, frozen = split(whole)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config is whole.config.text_config
    owned = {id(p) for p in whole.parameters()}
    assert all(id(p) in owned for p in model.parameters())  # shared, never copied
    assert sum(p.numel() for p in model.parameters()) + sum(t.numel() for t in frozen.values()) == sum(
        p.numel() for p in whole.parameters()
    )
    assert frozen and all(k.startswith(("model.vision_tower.", "model.multi_modal_projector.")) for k in frozen)
    assert not any(t.requires_grad for t in frozen.values())


def test_a_multimodal_model_that_computes_text_otherwise_is_refused(gemma3_folder):
    """The split is checked on its logits, not assumed from the family: a whole model whose text-only
    logits differ from its language model's (here: shifted by a hook) is refused in one line."""
    whole = AutoModelForImageTextToText.from_pretrained(gemma3_folder)
    whole.register_forward_hook(lambda module, args, out: out.__class__(logits=out.logits + 1))
    with pytest.raises(
        MultimodalError,
        match=r"^Gemma3ForConditionalGeneration computes text otherwise than its "
        r"language model as Gemma3ForCausalLM \(max \|logit difference\| 1 ",
    ):
        split(whole)


def test_the_vision_tower_is_left_out_of_the_step(gemma3_folder, tokenizer):
    model = built(gemma3_folder, tokenizer)
    assert model.config.model_type == "gemma3_text" and model.multimodal.frozen  # kept, on rank 0, for export
    assert {type(layer).__name__ for layer in model.decoder_layers()} == {"Gemma3DecoderLayer"}  # the FSDP units
    assert not any("vision" in name or "projector" in name for name, _ in model.named_parameters())
    optimizer = build_optimizer(model, OptimConfig())
    assert sum(p.numel() for group in optimizer.param_groups for p in group["params"]) == sum(
        p.numel() for p in model.parameters()
    )


def train_a_step(model) -> torch.optim.Optimizer:
    """One AdamW step on a random packed-free batch: every language-model weight moves."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(3, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    model(ids, torch.arange(24)[None], attention_mask=torch.ones_like(ids)).float().square().mean().backward()
    optimizer.step()
    return optimizer


class NoSampler:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def save(model, optimizer, tokenizer, run_dir):
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return Checkpointer(CheckpointConfig(), run_dir).save(
        1, TrainingState(model, optimizer, scheduler, NoSampler(), tokenizer), tokens_seen=24, total_steps=1
    )


def assert_exported_like_the_folder(out, folder, model):
    """``out`` is ``folder``'s architecture with the trained language model: it loads with transformers' own
    class, its language model gives ``model``'s logits, the rest of its weights are ``folder``'s bit for bit."""
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"] and config["model_type"] == "gemma3"
    assert json.loads((out / "preprocessor_config.json").read_text()) == PREPROCESSOR
    exported = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(exported).__name__ == "Gemma3ForConditionalGeneration"
    ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        trained = model(ids, torch.arange(16)[None], attention_mask=torch.ones_like(ids))
        torch.testing.assert_close(exported(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)
    before, after = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)  # the folder's own parameter names
    kept = [k for k in before if torch.equal(before[k], after[k])]
    assert kept and all("language_model" not in k for k in kept)  # every language-model weight trained
    assert {k for k in before if "vision_tower" in k or "multi_modal_projector" in k} <= set(kept)


def test_export_writes_the_multimodal_architecture_back(gemma3_folder, tokenizer, tmp_path):
    model = built(gemma3_folder, tokenizer)
    checkpoint = save(model, train_a_step(model), tokenizer, tmp_path / "run")
    assert (checkpoint / "hf" / MULTIMODAL_DIR / FROZEN_WEIGHTS).is_file()
    assert json.loads((checkpoint / "hf" / "config.json").read_text())["model_type"] == "gemma3_text"  # trained
    out = export(checkpoint, tmp_path / "out")
    assert_exported_like_the_folder(out, gemma3_folder, model)


def test_lora_on_the_language_model_exports_merged_into_the_multimodal_model(gemma3_folder, tokenizer, tmp_path):
    peft = PeftConfig(method="lora", rank=4, target_modules=["q_proj", "v_proj"])
    model = apply_peft(built(gemma3_folder, tokenizer), peft, ModelConfig(name_or_path=str(gemma3_folder)), 0)
    with torch.no_grad():  # adapters start as a no-op (B = 0): move them, so the merge changes the weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    checkpoint = save(model, optimizer, tokenizer, tmp_path / "run")
    out = export(checkpoint, tmp_path / "out")
    exported = AutoModelForImageTextToText.from_pretrained(out).eval()
    ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        trained = model(ids, torch.arange(16)[None], attention_mask=torch.ones_like(ids))
        torch.testing.assert_close(exported(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="format=merged"):
        export(checkpoint, tmp_path / "adapter", format="adapter")


def test_the_route_follows_the_text_familys_verdict(gemma3_folder, tokenizer, monkeypatch):
    """Generic, not per family: the day a text family's verdict changes, its multimodal checkpoints follow."""
    monkeypatch.setattr(families, "EXACT", families.EXACT - {"gemma3_text"})
    monkeypatch.setitem(families.REFUSED, "gemma3_text", families.OWN_MASK)
    with pytest.raises(
        FamilyRefusedError,
        match=r"^model family 'gemma3_text' is not certified exact \(table prior\): its attention adds",
    ):
        built(gemma3_folder, tokenizer)
    assert verdict("gemma3").kind == "refused"


def test_a_random_multimodal_model_is_refused_with_its_text_family():
    with pytest.raises(ConfigError, match=r"^model.family=gemma3 is a multimodal model: .*model.family=gemma3_text"):
        model_config(ModelConfig(family="gemma3"))


@pytest.mark.parametrize(
    "model_type,config",
    [
        (
            "mistral3",
            dict(
                text_config=dict(model_type="mistral", vocab_size=1600, **TEXT),
                image_token_index=1599,
                vision_config=dict(
                    model_type="pixtral",
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    head_dim=8,
                    image_size=32,
                    patch_size=8,
                ),
            ),
        ),
        (
            "llama4",
            dict(
                text_config=dict(
                    model_type="llama4_text",
                    vocab_size=1600,
                    intermediate_size_mlp=64,
                    num_local_experts=2,
                    attention_chunk_size=512,
                    **TEXT,
                ),
                vision_config=dict(
                    model_type="llama4_vision_model",
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    image_size=28,
                    patch_size=14,
                    vision_output_dim=32,
                    projector_input_dim=32,
                    projector_output_dim=32,
                ),
                boi_token_index=1597,
                eoi_token_index=1598,
                image_token_index=1599,
            ),
        ),
    ],
)
def test_other_families_route_in_one_line_whatever_the_outcome(model_type, config, tokenizer, tmp_path):
    """Mistral 3 printed transformers' traceback (no causal-LM class for its config); Llama 4 keeps its text
    causal LM as a module. Both now train their language model, judged as its text family."""
    model = built(tiny_folder(tmp_path / model_type, tokenizer, model_type, **config), tokenizer)
    assert model.config.model_type == config["text_config"]["model_type"] and model.multimodal.frozen


def test_a_folder_transformers_has_no_causal_lm_for_is_one_line(tokenizer, tmp_path):
    folder = tmp_path / "qwen2_vl"
    AutoConfig.for_model("qwen2_vl").save_pretrained(folder)  # its text model (qwen2_vl_text) has no causal LM
    with pytest.raises(
        FamilyRefusedError, match=r"^model family 'qwen2_vl' .*\(qwen2_vl_text\) is no causal-LM family"
    ):
        built(folder, tokenizer)
    AutoConfig.for_model("t5").save_pretrained(folder)
    with pytest.raises(FamilyRefusedError, match=r"^model family 't5' .*no causal-LM class"):
        built(folder, tokenizer)


IMAGE_CHAT = [
    {"role": "user", "content": [{"type": "image", "url": "cat.png"}, {"type": "text", "text": "What is it?"}]},
    {"role": "assistant", "content": "A cat."},
]
TEXT_CHAT = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi."}]


def test_images_in_the_data_are_refused_naming_the_record(tmp_path, tokenizer):
    path = tmp_path / "chats.jsonl"
    records = [{"messages": TEXT_CHAT}, {"messages": IMAGE_CHAT}, {"messages": TEXT_CHAT, "images": ["cat.png"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(source="jsonl", path=str(path))
    with pytest.raises(
        BadRecordError,
        match=(
            rf"^{path}:2: message 0 holds an 'image' part: packfsdp packs text-only examples; train the text-only "
            r"examples, or image\+text examples with a multimodal trainer \(data.on_bad_record=skip skips"
        ),
    ):
        render_records(load_records(cfg), tokenizer, cfg, max_length=512)
    skipping = DataConfig(source="jsonl", path=str(path), on_bad_record="skip")
    kept = render_records(load_records(skipping), tokenizer, skipping, max_length=512)
    assert len(kept) == 1 and kept.stats.dropped_bad == 2  # the text-only example trains; the others are counted
    with pytest.raises(ValueError, match=r"row 0: message 0 holds an 'image' part"):  # a table's parts, never dropped
        rows_to_records([{"messages": IMAGE_CHAT}], DataConfig(source="parquet"))
    saved = tmp_path / "saved"  # a dataset's image column is read to refuse its rows, not cut away unseen
    datasets.Dataset.from_list(
        [{"messages": TEXT_CHAT, "images": None}, {"messages": TEXT_CHAT, "images": ["cat.png"]}]
    ).save_to_disk(str(saved))
    with pytest.raises(BadRecordError, match=r"row 1: the record holds 'images': packfsdp packs text-only examples"):
        load_records(DataConfig(source="hf", path=str(saved)))
