"""The ``Checkpointer``: saves and restores a run's complete state (collective on every rank)."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from trainer import distributed
from trainer.checkpoint.config_check import JOB_CONFIG, check_resume_config, warn_world_size
from trainer.checkpoint.discovery import (
    FORMAT_VERSION,
    HF_DIR,
    MANIFEST,
    TRAINER_STATE,
    CheckpointError,
    DamagedCheckpointsError,
    checkpoint_name,
    complete_checkpoints,
    dcp_failure,
    find_checkpoint,
    is_checkpoint_name,
    read_json,
)
from trainer.checkpoint.manifest import file_stamps, fsync_dir, sizes_match, verify_checkpoint, write_manifest
from trainer.checkpoint.ownership import (
    CheckpointDirError,
    claim_checkpoint_dir,
    foreign_files,
    marked_by,
    shown,
    write_marker,
)
from trainer.checkpoint.rng import rng_tensors, set_rng_tensors
from trainer.checkpoint.safe_load import load_tensors
from trainer.config import CheckpointConfig, ConfigError
from trainer.model.lora import TRAINABLE_ONLY, base_mismatch, save_lora_assets, trainable_state_dict
from trainer.model.multimodal import save_multimodal_assets
from trainer.safety import redact_tree

log = logging.getLogger("trainer.checkpoint")

DATA_DIR = "data"
"""Per-rank data state (``data/rank_XXXXX.safetensors``) of samplers that have one (streaming)."""


def rank_file(checkpoint: Path, folder: str, rank: int) -> Path:
    """A rank's own file in a checkpoint: ``rng/`` (its RNG states) or ``data/`` (its stream state)."""
    return checkpoint / folder / f"rank_{rank:05d}.safetensors"


@dataclass
class TrainingState:
    """What a checkpoint saves and restores, besides the step counters."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: Any
    """Anything with ``state_dict()`` / ``load_state_dict()`` returning/taking plain JSON-able data."""
    tokenizer: Any = None
    """Saved with the model's transformers config under ``hf/`` so that export needs only the checkpoint."""


@dataclass
class Restored:
    step: int
    tokens_seen: int
    path: Path


def save_hf_assets(state: TrainingState, directory: Path) -> None:
    """The transformers config of the model (no weights) and the tokenizer."""
    config = getattr(state.model, "config", None)
    if config is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    # Secrets passed through model.config_overrides (hub tokens, keys) never reach the saved config.
    (directory / "config.json").write_text(json.dumps(redact_tree(config.to_dict()), indent=2, sort_keys=True) + "\n")
    if state.tokenizer is not None:
        state.tokenizer.save_pretrained(str(directory))
    save_lora_assets(state.model, directory)
    save_multimodal_assets(state.model, directory, redact_tree)  # a multimodal model's parts left out of the step


class Checkpointer:
    """Saves and restores a run's complete state with DCP; every method is collective (all ranks call it).

    Args:
        cfg: the checkpoint config.
        run_dir: the run directory (checkpoints go to ``<run_dir>/checkpoints`` unless ``cfg.dir`` is set).
        seed: the run's seed (re-seeds RNGs when a checkpoint was taken on a different world size).
        run_id: the run the checkpoints belong to (``trainer.run_dir``): saved in each (its marker and trainer
            state), and ``resume=auto`` and pruning consider only the checkpoints whose marker names it
            (``trainer.checkpoint.ownership``). ``None``: a library user's checkpointer, whose markers say so.
        job_config: the run's (redacted) config, saved in each checkpoint for ``check_config``.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: Path,
        seed: int = 0,
        run_id: str | None = None,
        job_config: dict | None = None,
    ) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.dir).expanduser() if cfg.dir else Path(run_dir) / "checkpoints"
        self.seed = seed
        self.run_id, self.job_config = run_id, job_config
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        self.run_dir = Path(run_dir)
        self._verified: tuple[Path, tuple] | None = None
        """The checkpoint ``resolve`` already verified (rank 0), so ``load`` does not hash it twice."""
        self._damaged: set[str] = set()
        """This run's checkpoints that did not verify (rank 0): kept as they are, never pruned or replaced."""

    def check_writable(self) -> None:
        """Fail on every rank, now, when the checkpoint dir cannot be written (not at the first save), belongs
        to another run or holds files packfsdp did not write (``ownership``)."""

        def probe() -> None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                probe_file = self.dir / f".write_probe.{os.getpid()}"
                probe_file.write_bytes(b"")
                probe_file.unlink()
            except OSError as e:
                raise ConfigError(
                    f"checkpoint dir {self.dir} is not writable ({e.strerror or e}); fix its permissions or set "
                    "checkpoint.dir to a writable folder"
                ) from None
            if self.run_id is not None:
                claim_checkpoint_dir(self.dir, self.run_id, self.run_dir)

        distributed.on_rank0_then_all(probe)

    def own(self, path: Path) -> bool:
        """Whether a checkpoint belongs to this run: its marker says so (``trainer.checkpoint.ownership``)."""
        return marked_by(path, self.run_id)

    def own_checkpoints(self) -> list[Path]:
        """This run's complete checkpoints, oldest first; another run's are never resumed or pruned."""
        return [p for p in complete_checkpoints(self.dir) if self.own(p)]

    def due(self, step: int, last_step: bool) -> bool:
        """Whether to save after ``step`` (``last_step``: the loop ends after this step)."""
        periodic = self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0
        return periodic or (last_step and self.cfg.at_end)

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint to resume from for ``resume`` = none | auto | a path (same answer on all ranks)."""
        if resume in ("none", "", None):
            return None
        if resume == "auto":
            path = self.latest_verified() if distributed.is_rank0() else None
        else:
            path = find_checkpoint(resume) if distributed.is_rank0() else None
        path = distributed.broadcast_object(str(path) if path else None)
        if resume == "auto" and path is None:
            log.info("resume=auto: no complete checkpoint in %s; starting from scratch", self.dir)
        return Path(path) if path else None

    def latest_verified(self) -> Path | None:
        """This run's newest checkpoint that verifies; a damaged newer one is skipped with a warning."""
        others = [p.name for p in complete_checkpoints(self.dir) if not self.own(p)]
        if others:
            log.warning(
                "resume=auto: ignoring %d checkpoint(s) of another run in %s (%s)",
                len(others),
                self.dir,
                ", ".join(others[:3]),
            )
        failures = []
        for path in reversed(self.own_checkpoints()):
            try:
                if self.cfg.verify:
                    verify_checkpoint(path)
            except CheckpointError as e:
                log.warning("resume=auto: skipping %s, it does not verify (kept as it is): %s", path.name, e)
                self._damaged.add(path.name)
                failures.append((path.name, e))
                continue
            self._verified = (path, file_stamps(path))
            return path
        if failures:  # damaged state is refused, never started over (and then pruned or replaced)
            raise DamagedCheckpointsError(
                f"resume=auto: none of the {len(failures)} checkpoint(s) of this run in {self.dir} verifies "
                f"({', '.join(name for name, _ in failures)}; newest: {failures[0][1]}); restore them, resume from "
                "a copy with resume=PATH, or start a new run with a new run_dir"
            )
        return None

    def check_config(self, path: Path, allowed: list[str], grad_accum: int) -> None:
        """Refuse (on every rank) a resume whose config changes what is trained (``config_check``)."""

        def check() -> None:
            state = read_json(path / TRAINER_STATE)
            saved = read_json(path / JOB_CONFIG)
            if not saved or self.job_config is None:
                log.warning("%s records no job config: the resume cannot check for changed settings", path)
                if state.get("world_size", self.world_size) != self.world_size:
                    warn_world_size(grad_accum, state["world_size"], self.world_size, grad_accum)
                return
            check_resume_config(
                saved, self.job_config, allowed, state.get("world_size", self.world_size), self.world_size, str(path)
            )

        distributed.on_rank0_then_all(check)

    # ------------------------------------------------------------------------------------------------ save
    def save(self, step: int, state: TrainingState, tokens_seen: int, total_steps: int) -> Path:
        start = time.perf_counter()
        final = self.dir / checkpoint_name(step)
        tmp = final.with_name(final.name + ".tmp")
        distributed.on_rank0_then_all(lambda: self._refuse_to_replace(final))  # every rank: one line, no hang
        if distributed.is_rank0():
            for stale in self.dir.glob("step_*.tmp"):  # left by a save of this run that crashed
                if marked_by(stale, self.run_id):
                    shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
            write_marker(tmp, self.run_id)
            (tmp / "rng").mkdir()
        distributed.barrier()

        # A forward under no_grad (eval) leaves blocks with reshard_after_forward=False gathered; save the
        # sharded parameters the optimizer holds, in the same layout every time.
        for module in state.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        model_sd = trainable_state_dict(state.model)
        optim_sd = get_optimizer_state_dict(state.model, state.optimizer)
        try:
            dcp.save({"model": model_sd, "optim": optim_sd["state"]}, storage_writer=FileSystemWriter(str(tmp)))
        except CheckpointException as e:  # a BaseException (a full disk, a lost mount): one line, not a trace
            raise dcp_failure(e, f"saving checkpoint {final}") from None
        save_file(rng_tensors(), str(rank_file(tmp, "rng", self.rank)))
        if hasattr(state.sampler, "save_rank_state"):  # a stream's position and buffer differ per rank
            state.sampler.save_rank_state(rank_file(tmp, DATA_DIR, self.rank))
        if distributed.is_rank0():
            scheduler = {k: v for k, v in state.scheduler.state_dict().items() if k != "lr_lambdas"}
            trainer_state = {
                "format": FORMAT_VERSION,
                "run_id": self.run_id,
                "step": step,
                "tokens_seen": tokens_seen,
                "total_steps": total_steps,
                "world_size": self.world_size,
                "sampler": state.sampler.state_dict(),
                "scheduler": scheduler,
                "optimizer_param_groups": optim_sd["param_groups"],
            }
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1, default=_jsonable))
            if self.job_config is not None:
                (tmp / JOB_CONFIG).write_text(json.dumps(self.job_config, indent=1, default=str))
            save_hf_assets(state, tmp / HF_DIR)
        distributed.barrier()  # every rank's files are on disk

        def finalize() -> None:
            try:
                self._finalize(tmp, final, step)
            except Exception as e:  # raised on every rank by on_rank0_then_all, never a hang
                raise CheckpointError(f"saving checkpoint {final} failed: {type(e).__name__}: {e}") from e

        distributed.on_rank0_then_all(finalize)
        log.info("checkpoint %s saved in %.2f s", final, time.perf_counter() - start)
        return final

    def _refuse_to_replace(self, final: Path) -> None:
        """A folder of this step's name that this run cannot prove it wrote (its marker), or that holds files
        its manifest does not list, is never replaced nor moved aside."""
        if not (final.exists() or final.is_symlink()):
            return
        if not marked_by(final, self.run_id):
            what = "was not written by this run"
        elif extra := foreign_files(final):
            what = f"holds files packfsdp did not write ({shown(extra)})"
        else:
            return
        raise CheckpointDirError(f"{final} {what}; not replacing it: move it away, or give a new checkpoint.dir")

    def _finalize(self, tmp: Path, final: Path, step: int) -> None:
        """Rank 0: manifest, then the atomic rename that makes the checkpoint count, then pruning."""
        write_manifest(tmp, step)
        replaced = None
        if final.exists() and self._is_damaged(final):  # kept for the user under another name, never replaced
            kept = final.with_name(f"{final.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(final, kept)
            log.warning("%s did not verify: kept as %s, the new save takes its name", final, kept.name)
        if final.exists():  # the same step saved again: keep the old copy until the new one is in place
            replaced = final.with_name(final.name + ".replaced")
            if marked_by(replaced, self.run_id):
                shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(tmp, final)
        fsync_dir(self.dir)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        if self.cfg.keep_last > 0:  # this run's only; keep_last counts the one just written, never pruned
            others = [p for p in self.own_checkpoints() if p != final and not self._is_damaged(p)]
            for old in others[: max(len(others) - (self.cfg.keep_last - 1), 0)]:
                if extra := foreign_files(old):  # removing it would delete them: kept, with its files
                    log.warning("not pruning %s: it holds files packfsdp did not write (%s)", old, shown(extra))
                    continue
                # Renamed first: a kill during the removal leaves a folder that is never loaded, not a
                # step folder that lost its manifest half-way through.
                doomed = old.with_name(old.name + ".pruned")
                os.replace(old, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
        self.clean_orphans()

    def clean_orphans(self) -> None:
        """Leftovers of a kill (a step folder without a manifest, a half-pruned or replaced one): never
        loadable, so removed. ``.tmp`` folders are the next save's to clear."""
        for path in self.dir.glob("step_*"):
            if not path.is_dir() or path.name.endswith(".tmp") or ".damaged-" in path.name:
                continue
            if not marked_by(path, self.run_id):  # another tool's or another run's: never removed
                continue
            if not is_checkpoint_name(path.name) or not (path / MANIFEST).is_file():
                log.info("removing %s: left incomplete by an interrupted save or prune", path)
                shutil.rmtree(path, ignore_errors=True)

    def _is_damaged(self, path: Path) -> bool:
        """Known not to verify (``resolve``), or its files' sizes differ from its manifest (cheap: no hashing)."""
        return path.name in self._damaged or not sizes_match(path)

    # ------------------------------------------------------------------------------------------------ load
    def load(self, path: Path, state: TrainingState, total_steps: int) -> Restored:
        """Restore ``state`` from ``path``; returns the step and tokens seen to continue from."""
        start = time.perf_counter()

        def verify() -> None:  # rank 0 reads every file once; a bad checkpoint fails on every rank
            if self.cfg.verify and self._verified != (path, file_stamps(path)):
                verify_checkpoint(path)
            elif not (path / MANIFEST).is_file():
                raise CheckpointError(f"{path} is incomplete (no {MANIFEST})")

        distributed.on_rank0_then_all(verify)
        if (mismatch := base_mismatch(state.model, path / HF_DIR)) is not None:
            raise CheckpointError(f"{path} cannot resume this run: {mismatch}")

        saved = json.loads((path / TRAINER_STATE).read_text())
        if saved.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"{path}: checkpoint format {saved.get('format')} is not {FORMAT_VERSION}")
        model_sd = trainable_state_dict(state.model)
        optim_sd = get_optimizer_state_dict(state.model, state.optimizer)
        tensors = {"model": model_sd, "optim": optim_sd["state"]}
        load_tensors(tensors, path)
        set_model_state_dict(state.model, tensors["model"], options=TRAINABLE_ONLY)
        set_optimizer_state_dict(
            state.model, state.optimizer, {"state": tensors["optim"], "param_groups": saved["optimizer_param_groups"]}
        )
        state.scheduler.load_state_dict(saved["scheduler"] | {"lr_lambdas": [None] * len(state.optimizer.param_groups)})
        try:
            state.sampler.load_state_dict(saved["sampler"])
            if hasattr(state.sampler, "load_rank_state"):
                state.sampler.load_rank_state(rank_file(path, DATA_DIR, self.rank))
        except ValueError as e:
            raise CheckpointError(f"{path}: the data sampler cannot resume here: {e}") from e
        self._restore_rng(path, saved["world_size"], saved["step"])
        if saved["total_steps"] != total_steps and distributed.is_rank0():
            log.warning(
                "the checkpoint's schedule spans %d steps, this run's %d: the learning-rate schedule changes "
                "from here on (set max_steps to keep it)",
                saved["total_steps"],
                total_steps,
            )
        log.info(
            "resumed from %s: step %d, %d tokens seen, saved on %d rank(s), now %d (%.2f s)",
            path,
            saved["step"],
            saved["tokens_seen"],
            saved["world_size"],
            self.world_size,
            time.perf_counter() - start,
        )
        return Restored(step=saved["step"], tokens_seen=saved["tokens_seen"], path=path)

    def _restore_rng(self, path: Path, saved_world_size: int, step: int) -> None:
        if saved_world_size == self.world_size:
            set_rng_tensors(load_file(str(rank_file(path, "rng", self.rank))))
            return
        # Ranks do not map one to one: give each rank a fresh stream that is still a function of the run.
        seed = (self.seed * 1_000_003 + step * 1_009 + self.rank) % 2**31
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        log.warning(
            "RNG states re-seeded: the checkpoint was saved on %d rank(s), this run has %d",
            saved_world_size,
            self.world_size,
        )


def _jsonable(value: Any) -> Any:
    """numpy scalars and arrays (e.g. in a sampler's state) as plain JSON numbers and lists."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable (checkpoint trainer state)")
