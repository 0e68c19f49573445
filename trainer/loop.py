"""Stage 6: the training loop, one ``Trainer`` with one method per phase.

``setup`` (build everything), ``next_step_batches`` (this rank's micro-batches of one optimizer step),
``forward_backward`` (one micro-batch), ``train_step`` (accumulate, clip, step, log) and ``train`` (the loop
and the summary). The command users type, ``torchrun ... -m trainer.train``, is ``trainer/train.py``.

The loop never asks which objective runs nor how a row is laid over the ranks: the objective
(``trainer.objectives``, chosen by ``objective=``) gives each micro-batch's loss and its share of the step's
objective, over the step's global counts (one all-reduce before the backward passes), so packed, padded and
any world size optimise the same objective; the parallel route (``trainer.parallel``, chosen by
``parallel.cp``) gives this rank's part of each micro-batch, in the step's one context.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from trainer import distributed
from trainer.checkpoint import Checkpointer, TrainingState
from trainer.collate import Batch
from trainer.config import JobConfig, stated_context
from trainer.data import load_tokenizer
from trainer.data.examples import unigram_entropy
from trainer.guard import StepGuard
from trainer.metrics import (
    SUMMARY_FILE,
    EvalMetrics,
    MetricsLogger,
    ProgressBar,
    RunSummary,
    StepMetrics,
    peak_memory_gib,
    setup_logging,
    trim_metrics,
)
from trainer.model import DTYPES, build_model
from trainer.model.certification import certify, worst_case_microbatch
from trainer.model.lora import apply_peft
from trainer.objectives import RunSetup, build_objective
from trainer.optim import build_optimizer, build_scheduler
from trainer.parallel import build_mesh, build_route, parallelize, set_gradient_sync
from trainer.pipeline import build_training_data, resolve_attention
from trainer.preemption import StepBoundary
from trainer.run_dir import RunDir, claim_run_dir
from trainer.safety import redact_tree, user_code
from trainer.throughput import StepCounts, flop_params, model_flops, peak_tflops

log = logging.getLogger("trainer")


class Trainer:
    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.step = 0
        self.last_checkpoint: Path | None = None
        self.tokens_seen = 0
        """Label tokens trained on so far, over all ranks (restored on resume)."""
        self.setup()

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        self.start_distributed()
        # Resolve the backend first: a backend that cannot run here fails before any heavy work.
        self.backend = resolve_attention(cfg, self.device)
        self.tokenizer = load_tokenizer(cfg.model, cfg.data)
        model = apply_peft(
            build_model(cfg.model, self.tokenizer, self.backend, cfg.seed), cfg.peft, cfg.model, cfg.seed
        )
        if cfg.packing.packed:
            log.info("attention backend: %s (%s) for packed batches", self.backend.name, self.backend.description)
        else:
            log.info("attention backend: transformers sdpa with a padding mask (padded baseline)")
        self.build_data(stated_context(model.config))

        self.flop_params = flop_params(model)
        self.peak_tflops, self.peak_source = peak_tflops(self.device, cfg.logger.peak_tflops)
        model = model.to(self.device)
        self.loss_impl = model.use_loss(cfg.loss.impl, cfg.loss.chunk_tokens)
        log.info("loss: %s", self.loss_impl)
        self.objective = build_objective(cfg, model)
        self.route = build_route(cfg.parallel, self.rank, self.world_size)
        self.route.prepare(model, self.sampler)
        self.certificate = self.certify_model(model)  # before FSDP: the unsharded model (through the route)
        mesh = build_mesh(self.device, self.world_size, cfg.parallel)
        dtype = cfg.parallel.param_dtype
        self.model = self.objective.setup(
            model,
            RunSetup(
                partial(parallelize, mesh=mesh, cfg=cfg.parallel),
                [self.dataset, self.eval_dataset],
                cfg.row_budget,
                self.device,
                self.tokenizer.pad_token_id,
                DTYPES[dtype],
                (dtype, self.backend.name, self.loss_impl),
            ),
        )
        log.info("objective: %s", self.objective.describe())
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.total_steps = self.count_total_steps()
        same = {"the number of optimizer steps": self.total_steps}
        if not cfg.data.stream.enabled:  # a stream's examples are dealt as read: each rank counts its own
            same["the number of examples"] = len(self.dataset)
        distributed.check_same_on_all_ranks(same, self.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        saved_config = self.checkpointer.job_config  # what checkpoints and wandb keep of the config (redacted)
        self.resume()
        self.metrics = MetricsLogger(cfg.logger, self.run_dir, self.rank == 0, run_config=saved_config)
        self.summary = RunSummary(skip=cfg.summary_skip_steps)
        if not cfg.data.stream.enabled:  # a stream's length is unknown (pipeline logs its window instead)
            log.info(
                "%d examples, %d micro-batches per rank per epoch, %d optimizer steps",
                len(self.dataset),
                self.sampler.microbatches_per_rank(0),
                self.total_steps,
            )

    def start_distributed(self) -> None:
        """Device, process group, logging, the step guard and the run directory every rank agrees on."""
        cfg = self.cfg
        self.device = distributed.resolve_device(cfg.parallel.device)
        distributed.init_distributed(
            self.device, cfg.parallel.backend, cfg.guard.collective_timeout_s, cpu_offload=cfg.parallel.cpu_offload
        )
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        setup_logging(self.rank)
        self.guard = StepGuard(cfg.guard, self.device)
        self.owner: RunDir = claim_run_dir(cfg)
        self.run_dir = self.owner.path
        self.checkpointer = Checkpointer(
            cfg.checkpoint, self.run_dir, cfg.seed, run_id=self.owner.run_id, job_config=redact_tree(asdict(cfg))
        )
        self.checkpointer.check_writable()  # an unwritable or foreign checkpoint dir fails now, before any heavy work
        log.info("run dir %s | %d rank(s) on %s", self.run_dir, self.world_size, self.device)
        if self.rank == 0 and (imported := user_code(asdict(cfg))):
            log.warning("user code this run imports: %s", "; ".join(imported))

    def build_data(self, context: int | None) -> None:
        """The examples, held-out set and sampler (``trainer.pipeline``: the tools see the same ones)."""
        cfg = self.cfg
        data = build_training_data(cfg, self.rank, self.world_size, tokenizer=self.tokenizer, context=context)
        self.dataset, self.eval_dataset, self.sampler, self.collate = (
            data.dataset,
            data.eval_dataset,
            data.sampler,
            data.collate,
        )
        self.check_examples = data.check_examples()
        """The examples and plan the startup self-check draws its batch from (streaming: the stream's head)."""
        log.info(
            "held out for eval: %d examples (%s)",
            len(self.eval_dataset or []),
            f"every {cfg.eval.every} steps and at the end" if self.eval_dataset else "eval off",
        )
        if not cfg.packing.packed:
            log.info("padded baseline: %d examples per micro-batch", self.sampler.padded_batch_size)

    def certify_model(self, model: torch.nn.Module):
        """The model's certificate (``trainer.model.certification``): the stages ``build_model`` ran, then the
        startup self-check on a worst-case batch of the run's examples, through the run's route (under cp > 1,
        sharded over the real CP group) and the objective's loss of the check; its one line is logged."""
        if not self.cfg.model.self_check:
            return certify(model)
        dataset, sampler = self.check_examples
        first = self.objective.check_indices(worst_case_microbatch(sampler), dataset.lengths, self.cfg.row_budget)
        return certify(
            model,
            self.collate(dataset, first, self.tokenizer.pad_token_id),
            self.cfg.model.self_check_tolerance,
            DTYPES[self.cfg.parallel.param_dtype],
            first,
            self.route.self_check_route(model),
            self.objective.check_loss(),
        )

    def training_state(self) -> TrainingState:
        return TrainingState(self.model, self.optimizer, self.scheduler, self.sampler, self.tokenizer)

    def resume(self) -> None:
        """Restore everything from the checkpoint ``cfg.resume`` names (``auto``: this run's latest one that
        verifies), after checking that its config allows it (``trainer.checkpoint.config_check``)."""
        path = self.checkpointer.resolve(self.cfg.resume)
        if path is not None:
            self.checkpointer.check_config(path, self.cfg.resume_allow_changes, self.cfg.grad_accum)
            restored = self.checkpointer.load(path, self.training_state(), self.total_steps)
            self.step, self.tokens_seen = restored.step, restored.tokens_seen
        if self.rank == 0:  # steps (and evals) logged after the checkpoint, or by a restart from scratch
            trim_metrics(self.run_dir, self.step)

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.step, self.training_state(), self.tokens_seen, self.total_steps)

    def count_total_steps(self) -> int:
        if self.cfg.max_steps is not None:
            return self.cfg.max_steps
        per_epoch = (
            math.ceil(self.sampler.microbatches_per_rank(e) / self.cfg.grad_accum) for e in range(self.cfg.epochs)
        )
        return sum(per_epoch)

    # ------------------------------------------------------------------------------------------------- loop
    def next_step_batches(self) -> list[Batch]:
        """Up to ``grad_accum`` collated micro-batches; a step never crosses an epoch boundary. Every rank gets the
        same count because every rank's epoch plan has the same length."""
        batches = []
        for _ in range(self.cfg.grad_accum):
            _, indices, last_of_epoch = self.sampler.next_microbatch()
            batches.append(self.collate(self.dataset, indices, self.tokenizer.pad_token_id))
            if last_of_epoch:
                break
        self.dataset.check_unchanged()  # after the reads: a cache edited under the run stops it before it trains on it
        return batches

    def forward_backward(self, batch: Batch, counts: StepCounts) -> torch.Tensor:
        """The objective's summed loss of one micro-batch; backward of its share of the step's objective (over the
        step's global ``counts``: ``trainer.objectives.base``)."""
        loss = self.objective.loss(self.model, batch, counts)
        loss.objective.backward()
        return loss.loss_sum.detach()

    def train_step(self) -> StepMetrics:
        """One optimizer step over this rank's micro-batches (through the parallel route), applied or skipped on
        every rank together."""
        start = time.perf_counter()
        distributed.note_step(self.step + 1)  # the heartbeat tells the other ranks which step this one is in
        with self.route.step(self.next_step_batches(), self.device) as batches:
            counts = StepCounts.of(batches, self.objective.units).all_reduced(self.device)
            loss_sum = torch.zeros((), device=self.device)
            for i, batch in enumerate(batches):
                set_gradient_sync(self.model, i == len(batches) - 1)
                loss_sum += self.forward_backward(batch, counts)
        grad_norm = clip_grad_norm(self.model, self.cfg.optim.grad_clip)
        # Every rank reaches the same verdict (one all-reduce): apply, or skip on all ranks together.
        verdict = self.guard.check(self.step + 1, loss_sum.item(), grad_norm, counts.label_tokens)
        lr = self.optimizer_step(apply=verdict.skip is None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step += 1
        metrics = StepMetrics.measure(
            counts,
            step=self.step,
            epoch=self.sampler.epoch,
            lr=lr,
            grad_norm=grad_norm,
            skipped=verdict.skip,
            step_time_s=time.perf_counter() - start,
            peak_mem_gib=peak_memory_gib(self.device),
            model_flops=model_flops(counts.tokens, counts.sum_squared_lengths, self.flop_params),
            tokens_seen_before=self.tokens_seen,
            **self.objective.step_metrics(verdict.loss_sum, counts, self.device),
            **self.route.step_metrics(),
        )
        self.tokens_seen = metrics.tokens_seen
        return metrics

    def optimizer_step(self, apply: bool) -> float:
        """Apply the accumulated gradients (or drop them) and advance the schedule; the lr the step used."""
        if apply:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return lr

    def train(self) -> dict:
        self.model.train()
        every = self.cfg.eval.every
        end = min(self.total_steps, self.cfg.stop_after_steps or self.total_steps)
        if self.step >= end:  # e.g. a restart after the final checkpoint: the run is already complete
            log.info("resumed at step %d of %d: nothing left to train", self.step, end)
            self.metrics.close()
            self.owner.release()
            return {"steps": 0, "resumed_step": self.step, "run_dir": str(self.run_dir)}
        with (
            StepBoundary(self.cfg.checkpoint.every_minutes, self.device) as boundary,
            ProgressBar(self.total_steps, self.cfg.logger.progress_bar and self.rank == 0) as bar,
        ):
            while self.step < end:
                metrics = self.train_step()
                self.summary.add(metrics)
                bar.update(metrics)
                if self.step % self.cfg.logger.log_every == 0 or self.step == end:
                    self.metrics.log(metrics)
                if self.step == self.total_steps or (every and self.step % every == 0):
                    with boundary.long_phase("eval"):  # the watchdog's grace counts the eval, not a step
                        self.evaluate()
                stop_signal = self.after_step(boundary, last_step=self.step == end)
                if stop_signal and self.step < end:
                    return self.preempted(stop_signal)
        return self.finish()

    def after_step(self, boundary: StepBoundary, last_step: bool) -> str | None:
        """At the step boundary every rank agrees on (one all-reduce): save when the step cadence, the
        wall-clock cadence or a stop signal says so. Returns the stop signal's name, if any."""
        agreed = boundary.agree()
        if self.checkpointer.due(self.step, last_step) or agreed.clock_due or agreed.stop_signal:
            with boundary.saving_checkpoint():
                self.last_checkpoint = self.save_checkpoint()
        return agreed.stop_signal

    def preempted(self, stop_signal: str) -> dict:
        """Stopped by a signal after this step's checkpoint: the entry point exits with
        ``PREEMPTED_EXIT_CODE``, and ``resume=auto`` continues from that checkpoint exactly."""
        log.warning(
            "%s received: stopped after step %d with checkpoint %s; resume=auto continues from there",
            stop_signal,
            self.step,
            self.last_checkpoint,
        )
        self.metrics.close()
        self.owner.release()
        return {
            "preempted": stop_signal,
            "step": self.step,
            "checkpoint": str(self.last_checkpoint),
            "run_dir": str(self.run_dir),
        }

    def evaluate(self) -> EvalMetrics | None:
        """The objective's held-out loss (packed batches through the route; every rank takes part)."""
        if self.eval_dataset is None:
            return None
        result = EvalMetrics(
            step=self.step,
            **self.objective.evaluate(
                self.model, self.eval_dataset, self.cfg.row_budget, self.device, self.tokenizer.pad_token_id, self.route
            ),
        )
        self.eval_dataset.check_unchanged()  # before the result counts
        self.summary.add_eval(result)
        self.metrics.log_eval(result)
        return result

    def finish(self) -> dict:
        result = (
            self.summary.result(self.peak_tflops * self.world_size)
            | {
                "mode": "packed" if self.cfg.packing.packed else "padded",
                "objective": self.cfg.objective,
                "strategy": self.cfg.packing.strategy,
                "attention": self.backend.name if self.cfg.packing.packed else "sdpa_padded",
                "loss_impl": self.loss_impl,
                "compile": self.cfg.parallel.compile_backend if self.cfg.parallel.compile else "off",
                "world_size": self.world_size,
                "device": dist_device_name(self.device),
                "model_params": self.flop_params.params,
                "peft": self.cfg.peft.method,  # none (full fine-tuning) or lora
                "peak_tflops_per_device": self.peak_tflops,
                "peak_tflops_source": self.peak_source,
                "train_examples": len(self.dataset),
                "eval_examples": len(self.eval_dataset) if self.eval_dataset is not None else 0,
                "dataset": asdict(self.dataset.stats),
                # a scan of every token: for rank 0's summary.json only; a stream has no whole set
                "unigram_entropy": unigram_entropy(self.dataset.label_token_counts())
                if self.rank == 0 and hasattr(self.dataset, "label_token_counts")
                else float("nan"),
                "skipped_steps": dict(self.guard.skipped),
                "certification": self.certificate.to_json(),
                "run_dir": str(self.run_dir),
            }
            | self.metrics.wall_clock()
        )
        self.metrics.close()
        self.owner.release()
        if self.rank == 0:
            (self.run_dir / SUMMARY_FILE).write_text(json.dumps(json_safe(result), indent=2))
            mfu = f"MFU {100 * result['mfu']:.2f}% | " if math.isfinite(result["mfu"]) else ""  # no peak: no MFU
            log.info(
                "RESULT %s (%s): useful tokens/s %.0f | padding %.1f%% | final loss %.4f | eval loss %.4f | "
                "%s%d steps on %d rank(s)",
                result["mode"],
                result["strategy"],
                result["useful_tokens_per_s"],
                100 * result["padding_fraction"],
                result["final_loss"],
                result["final_eval_loss"],
                mfu,
                result["steps"],
                self.world_size,
            )
        return result


def json_safe(record: dict) -> dict:
    """NaN (an unknown MFU, no eval) becomes null so the file stays strict JSON."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def dist_device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Global gradient norm (across shards and ranks), clipped to ``max_norm`` when it is > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
