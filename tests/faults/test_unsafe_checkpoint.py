"""Item 6 (checkpoints): a pickle payload planted in a checkpoint directory is refused and never runs, even
when the manifest is rewritten to match it (the restricted unpickler of ``trainer.checkpoint``)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from trainer.checkpoint import Checkpointer, CheckpointError, TrainingState
from trainer.checkpoint.manifest import write_manifest
from trainer.config import CheckpointConfig


class Sampler:
    epoch, next_index = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": 0, "next_index": 0}

    def load_state_dict(self, state: dict) -> None:
        pass


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # harmless, but proof that code ran
        return (Path.touch, (self.marker,))


def _state() -> TrainingState:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return TrainingState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), Sampler())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pickle_payload_in_checkpoint_metadata_is_refused(tmp_path):
    checkpointer = Checkpointer(CheckpointConfig(), tmp_path)
    checkpointer.save(1, _state(), tokens_seen=0, total_steps=2)
    path = checkpointer.resolve("auto")
    marker = tmp_path / "payload_ran"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    write_manifest(path, 1)  # an attacker who can write the directory can rewrite the manifest too
    with pytest.raises(CheckpointError, match="not allowed"):
        checkpointer.load(path, _state(), total_steps=2)
    assert not marker.exists()
