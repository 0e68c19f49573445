"""Run the real Trainer under torchrun with test-only probes: ``python -m tests.distributed.harness OVERRIDES``.

Environment switches (all optional):
- ``PFTEST_OUT``: folder where rank 0 writes ``final.safetensors`` (full model + optimizer tensors after
  training), ``logits.safetensors`` (the trained sharded model's logits on one fixed example) and
  ``result.json``.
- ``PFTEST_DUMP_AFTER_RESUME=1``: also write ``after_resume.safetensors`` right after setup (resume), save
  a checkpoint of the resumed state on this world size, and stop there when the sampler refuses the
  checkpoint's world size (the error goes to ``result.json``).
- ``PFTEST_KILL=RANK:STEP``: on the first torchrun attempt, rank RANK SIGKILLs itself after step STEP.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from tests.quick_exit import run_then_exit
from trainer import distributed
from trainer.checkpoint import TRAINER_STATE, CheckpointError
from trainer.collate import collate_packed
from trainer.compose import config_dir, register_configs, to_job_config
from trainer.loop import Trainer


def full_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Full (unsharded) model and optimizer tensors on rank 0 (collective)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {f"model/{k}": v for k, v in get_model_state_dict(trainer.model, options=opts).items()}
    optim = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=opts)
    for fqn, state in optim.get("state", {}).items():  # empty off rank 0
        for key, value in state.items():
            out[f"optim/{fqn}/{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def probe_logits(trainer: Trainer) -> torch.Tensor:
    """Logits of the sharded model on example 0 as a packed batch of one (collective)."""
    dataset = trainer.check_examples[0]  # streaming: the stream's head
    batch = collate_packed(dataset, [0], trainer.tokenizer.pad_token_id).to(trainer.device)
    trainer.model.eval()  # no dropout: the exported model is compared in eval mode
    with torch.no_grad():
        logits = trainer.model(**batch.model_inputs())
    trainer.model.reshard()
    return torch.cat([batch.input_ids.float()[..., None], logits.float()], dim=-1)[0]


class HarnessTrainer(Trainer):
    def __init__(self, cfg, out: Path | None) -> None:
        self.out, self.sampler_error = out, None
        self.consumed: dict[int, list[int]] = {}
        kill = os.environ.get("PFTEST_KILL")
        self.kill = tuple(int(x) for x in kill.split(":")) if kill else None
        super().__init__(cfg)

    def resume(self) -> None:
        try:
            super().resume()
        except CheckpointError as e:
            if "sampler" not in str(e) or not os.environ.get("PFTEST_DUMP_AFTER_RESUME"):
                raise
            self.sampler_error = str(e)  # model, optimizer and scheduler were loaded before the sampler
            saved = json.loads((self.checkpointer.resolve(self.cfg.resume) / TRAINER_STATE).read_text())
            self.step, self.tokens_seen = saved["step"], saved["tokens_seen"]
        if os.environ.get("PFTEST_DUMP_AFTER_RESUME"):
            tensors = full_tensors(self)
            if self.rank == 0:
                save_file(tensors, str(self.out / "after_resume.safetensors"))
            # Re-saved on this world size (the sampler keeps its fresh state if it refused the old one).
            self.save_checkpoint()

    def next_step_batches(self):
        batches = super().next_step_batches()
        self.consumed.setdefault(self.step + 1, []).extend(i for b in batches for i in b.example_ids)
        return batches

    def gathered_examples(self) -> dict[int, list[int]]:
        """Example ids trained on per step, over all ranks (collective)."""
        parts = [None] * self.world_size
        torch.distributed.all_gather_object(parts, self.consumed)
        merged: dict[int, list[int]] = {}
        for part in parts:
            for step, ids in part.items():
                merged.setdefault(step, []).extend(ids)
        return {step: sorted(ids) for step, ids in sorted(merged.items())}

    def train_step(self) -> dict:
        metrics = super().train_step()
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.kill and first_attempt and (self.rank, self.step) == self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        return metrics


def main(overrides: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where a hung rank is
    register_configs()
    with initialize_config_dir(str(config_dir()), version_base=None):
        cfg = to_job_config(compose("config", overrides))
    out = Path(os.environ["PFTEST_OUT"]) if os.environ.get("PFTEST_OUT") else None
    if out and distributed.rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    try:
        trainer = HarnessTrainer(cfg, out)
        result = {"sampler_error": trainer.sampler_error, "resumed_step": trainer.step}
        if trainer.sampler_error is None:
            result |= trainer.train()
            result["examples"] = trainer.gathered_examples()
            if out:
                tensors, logits = full_tensors(trainer), probe_logits(trainer)
                if trainer.rank == 0:
                    save_file(tensors, str(out / "final.safetensors"))
                    save_file({"logits": logits}, str(out / "logits.safetensors"))
        if out and trainer.rank == 0:
            (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    except BaseException:
        raise  # no barrier: the other ranks may be inside a collective; torchrun stops them
    distributed.destroy_distributed()


if __name__ == "__main__":
    run_then_exit(main, sys.argv[1:])
