"""HF export: the consolidated safetensors model gives the logits of the trained, sharded model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.tools.export import main as export_main

pytestmark = pytest.mark.slow


def test_export_matches_the_sharded_model(reference, tmp_path):
    out = tmp_path / "hf"
    # In process (saves an interpreter start): what `python -m trainer.export checkpoint=RUN out=DIR` runs.
    export_main([f"checkpoint={reference / 'run'}", f"out={out}"])
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert json.loads((out / "packfsdp_export.json").read_text())["step"] == 10  # the latest checkpoint

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    probe = load_file(reference / "out" / "logits.safetensors")["logits"]  # [tokens, 1 + vocab]
    input_ids = probe[:, 0].long()[None]
    assert tokenizer.decode(input_ids[0]).strip()  # the tokenizer came along and decodes the ids
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits[0]
    torch.testing.assert_close(logits, probe[:, 1:], rtol=1e-5, atol=1e-5)


def test_export_refuses_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit, match="usage"):
        export_main(["checkpoint=x"])
    with pytest.raises(SystemExit, match="unexpected argument"):
        export_main(["checkpoint=x", "out=y", "shard=3"])
    with pytest.raises(SystemExit) as e:
        export_main([f"checkpoint={tmp_path}", f"out={tmp_path / 'o'}"])
    assert e.value.code == 2 and "no complete checkpoint" in capsys.readouterr().err
