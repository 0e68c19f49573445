"""Item 6 (files): tensors load only from safetensors or ``torch.load(weights_only=True)``; a pickle
payload is refused, naming the file, and never runs (tested with a harmless payload that would create a
marker file)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trainer.checkpoint.safe_load import load_tensor_file as load_tensors
from trainer.safety import UnsafeFileError


class Payload:
    """Unpickling this calls ``Path.touch(marker)``: harmless, but proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickle_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload_ran"
    bad = tmp_path / "model.pt"
    torch.save({"weight": torch.ones(2), "extra": Payload(marker)}, bad)
    with pytest.raises(UnsafeFileError, match=rf"{bad}: refused to load: it is a pickle"):
        load_tensors(bad)
    assert not marker.exists()
    raw = tmp_path / "optimizer.bin"  # a bare pickle, not even torch.save
    raw.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeFileError):
        load_tensors(raw)
    assert not marker.exists()


def test_safetensors_and_plain_tensor_files_load(tmp_path):
    save_file({"w": torch.arange(4.0)}, tmp_path / "model.safetensors")
    assert torch.equal(load_tensors(tmp_path / "model.safetensors")["w"], torch.arange(4.0))
    torch.save({"w": torch.arange(3), "step": 7, "names": ["a"]}, tmp_path / "state.pt")
    state = load_tensors(tmp_path / "state.pt")
    assert state["step"] == 7 and torch.equal(state["w"], torch.arange(3))
