"""Stage 6: the training loop, one ``Trainer`` with one method per phase.

``setup`` (build everything), ``next_step_batches`` (this rank's micro-batches of one optimizer step),
``forward_backward`` (one micro-batch), ``train_step`` (accumulate, clip, step, log) and ``train`` (the loop
and the summary). The command users type, ``torchrun ... -m trainer.train``, is ``trainer/train.py``.

The loss of a step is the sum of token losses over every micro-batch and every rank divided by the
global count of label tokens (one all-reduce before the backward passes), so packed, padded and any world
size optimise the same objective.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from trainer import distributed
from trainer.checkpoint import Checkpointer, TrainingState
from trainer.collate import Batch
from trainer.config import JobConfig, stated_context
from trainer.context_parallel import (
    CPRoute,
    check_same_row,
    new_cp_group,
    refuse_unshardable,
    row_lengths,
    shard_batch,
    split_skew,
    step_skew,
)
from trainer.data import load_tokenizer
from trainer.data.examples import holds_pairs, pair_splits_of, unigram_entropy
from trainer.evaluate import evaluate
from trainer.guard import FaultInjector, StepGuard
from trainer.loss import summed_token_loss
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
from trainer.model.lora import apply_peft
from trainer.model.selfcheck import run_startup_self_check, worst_case_microbatch
from trainer.optim import build_optimizer, build_scheduler
from trainer.packing import build_sampler
from trainer.pipeline import balance_cost, build_training_data, resolve_attention
from trainer.parallel import build_mesh, parallelize, set_gradient_sync
from trainer.preemption import StepBoundary
from trainer.preference import PAIR_SUMS, PairLossCheck, PreferenceObjective, preference_metrics
from trainer.preference.reference import plan_reference
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
        self.first_step = 0
        """The step this process started at (0, or the resumed one): the CP row check runs right after it."""
        self.setup()

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        self.start_distributed()
        # Resolve the backend first: a backend that cannot run here fails before any heavy work.
        self.backend = resolve_attention(cfg, self.device)
        self.tokenizer = load_tokenizer(cfg.model, cfg.data)
        model = apply_peft(build_model(cfg.model, self.tokenizer, self.backend, cfg.seed), cfg.peft, cfg.model, cfg.seed)
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
        self.cp = cfg.parallel.cp
        refuse_unshardable(model.model, self.cp)
        model.cp_group = new_cp_group(self.world_size, self.cp, self.rank)
        if cfg.model.self_check:  # before FSDP: the unsharded model (under cp, its CP route), before step 1
            self.startup_self_check(model)
        if self.cp > 1:
            rows = [row_lengths(b, self.dataset.lengths) for round_ in self.sampler.plan(0).rounds[:64] for b in round_]
            log.info("context parallel: cp=%d (%s split), %d data-parallel group(s), rows of %d tokens; attention-cost "
                     "skew across the group (first 64 rounds): contiguous %.1f%%, balanced %.1f%%",
                     self.cp, cfg.parallel.cp_split, self.world_size // self.cp, cfg.row_budget,
                     100 * split_skew(rows, self.cp, "contiguous"), 100 * split_skew(rows, self.cp, "balanced"))
        mesh = build_mesh(self.device, self.world_size, cfg.parallel)
        reference = plan_reference(cfg.dpo, model, cfg.parallel.param_dtype, self.backend.name, self.loss_impl,
                                   dtype=DTYPES[cfg.parallel.param_dtype]) if cfg.objective == "dpo" else None
        self.model = parallelize(model, mesh, cfg.parallel)
        self.objective = self.preference_objective(reference, mesh)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.total_steps = self.count_total_steps()
        same = {"the number of optimizer steps": self.total_steps}
        if not cfg.data.stream.enabled:  # a stream's examples are dealt as read: each rank counts its own
            same["the number of examples"] = len(self.dataset)
        distributed.check_same_on_all_ranks(same, self.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        saved_config = redact_tree(asdict(cfg))  # what checkpoints and wandb keep of the config
        self.checkpointer = Checkpointer(
            cfg.checkpoint, self.run_dir, cfg.seed, run_id=self.owner.run_id, job_config=saved_config
        )
        self.checkpointer.check_writable()  # a read-only checkpoint dir fails now, not at the first save
        self.resume()
        self.metrics = MetricsLogger(cfg.logger, self.run_dir, self.rank == 0, run_config=saved_config)
        self.summary = RunSummary(skip=cfg.summary_skip_steps)
        if not cfg.data.stream.enabled:  # a stream's length is unknown (pipeline logs its window instead)
            log.info(
                "%d examples, %d micro-batches per rank per epoch, %d optimizer steps",
                len(self.dataset), self.sampler.microbatches_per_rank(0), self.total_steps,
            )

    def preference_objective(self, reference, mesh) -> PreferenceObjective | None:
        """``objective=dpo``: the objective with its reference (``trainer.preference``), built after the
        policy is sharded (a live copy is sharded the same way; ``precompute`` runs its pass now)."""
        if reference is None:
            return None
        no_grad = replace(self.cfg.parallel, activation_checkpointing="none")  # nothing to recompute
        ref = reference.build(self.model, lambda m: parallelize(m, mesh, no_grad),
                              [self.dataset, self.eval_dataset], self.cfg.packing.token_budget, self.device,
                              self.tokenizer.pad_token_id)
        objective = PreferenceObjective(self.cfg.dpo, ref)
        log.info("objective: %s", objective.describe())
        return objective

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
        self.faults = FaultInjector.from_env(self.rank)
        self.owner: RunDir = claim_run_dir(cfg)
        self.run_dir = self.owner.path
        log.info("run dir %s | %d rank(s) on %s", self.run_dir, self.world_size, self.device)
        if self.rank == 0 and (imported := user_code(asdict(cfg))):
            log.warning("user code this run imports: %s", "; ".join(imported))

    def build_data(self, context: int | None) -> None:
        """The examples, held-out set and sampler (``trainer.pipeline``: the tools see the same ones)."""
        cfg = self.cfg
        data = build_training_data(cfg, self.rank, self.world_size, tokenizer=self.tokenizer, context=context)
        self.dataset, self.eval_dataset, self.sampler, self.collate, self.probe = (
            data.dataset, data.eval_dataset, data.sampler, data.collate, data.probe
        )
        log.info("held out for eval: %d examples (%s)", len(self.eval_dataset or []),
                 f"every {cfg.eval.every} steps and at the end" if self.eval_dataset else "eval off")
        if not cfg.packing.packed:
            log.info("padded baseline: %d examples per micro-batch", self.sampler.padded_batch_size)

    def startup_self_check(self, model: torch.nn.Module) -> None:
        """A worst-case batch of the run's examples, as built and example by example (``trainer.model.selfcheck``);
        under cp > 1 the batch is a row, run sharded over the real CP group (``CPRoute``); under
        ``objective=dpo`` the gradient is the DPO loss's (``PairLossCheck``)."""
        dataset, sampler = self.dataset, self.sampler
        if self.probe is not None:  # streaming: the stream's first examples stand in for the dataset
            dataset = self.probe
            sampler = build_sampler(dataset.lengths, self.cfg.packing, 0, 1, self.cfg.seed,
                                    cost=balance_cost(self.cfg, self.tokenizer), pair_splits=pair_splits_of(dataset))
        first = worst_case_microbatch(sampler)
        if holds_pairs(dataset):  # pairs are packed whole: the pieces' pairs, as many as the budget holds
            first = whole_pairs(first, dataset.lengths, self.cfg.row_budget)
        batch = self.collate(dataset, first, self.tokenizer.pad_token_id)
        route = CPRoute(model, self.cp, self.rank % self.cp, self.cfg.parallel.cp_split) if self.cp > 1 else None
        loss = PairLossCheck(self.cfg.dpo) if self.cfg.objective == "dpo" else None
        run_startup_self_check(
            model, batch, self.cfg.model.self_check_tolerance, DTYPES[self.cfg.parallel.param_dtype], first, route, loss
        )
        if batch.num_pairs:
            log.info("startup self-check batch: %d preference pairs, their %d sequences each checked alone "
                     "(logits, reply log-probs, the %s's gradient)", batch.num_pairs, batch.num_examples, loss.describe())

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
        self.first_step = self.step  # the CP row check runs on the first step after start or resume
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
        """Up to ``grad_accum`` micro-batches; a step never crosses an epoch boundary. Every rank gets the
        same count because every rank's epoch plan has the same length."""
        batches = []
        for _ in range(self.cfg.grad_accum):
            _, indices, last_of_epoch = self.sampler.next_microbatch()
            batch = self.collate(self.dataset, indices, self.tokenizer.pad_token_id)
            if self.cp > 1:  # the group's row, this rank's shard of it
                if self.step == self.first_step:
                    check_same_row(batch, self.model.cp_group, self.device)
                batch = shard_batch(batch, self.cp, self.rank % self.cp, self.cfg.parallel.cp_split)
            batches.append(batch.to(self.device))
            self.faults.on_batch(batches[-1])
            if last_of_epoch:
                break
        return batches

    def forward_backward(self, batch: Batch, global_label_tokens: float) -> torch.Tensor:
        """Summed token loss (``objective=dpo``: summed pair loss) of one micro-batch; backward of its share of
        the global mean (``global_label_tokens``; for ``objective=dpo``, the global pair count)."""
        self.faults.before_forward()
        if self.objective is not None:
            loss_sum, sums = self.objective.loss_sum(self.model, batch)
            self.pair_sums += sums
        else:
            loss_sum = summed_token_loss(self.model, batch)
        loss_sum = self.faults.on_loss(loss_sum)
        # An all-masked micro-batch gives loss_sum == 0 (a sum over no token), so zero gradient, never NaN.
        (loss_sum / max(global_label_tokens, 1.0)).backward()  # objective=dpo: the global pair count
        return loss_sum.detach()

    def train_step(self) -> StepMetrics:
        """One optimizer step over this rank's micro-batches, applied or skipped on every rank together."""
        start = time.perf_counter()
        self.faults.before_step(self.step + 1)
        batches = self.next_step_batches()
        counts = StepCounts.of(batches).all_reduced(self.device)
        cp_skew = step_skew(batches, self.cp, self.device) if self.cp > 1 else None
        loss_sum = torch.zeros((), device=self.device)
        self.pair_sums = torch.zeros(len(PAIR_SUMS), dtype=torch.float64, device=self.device)
        global_count = counts.pairs if self.objective is not None else counts.label_tokens
        for i, batch in enumerate(batches):
            set_gradient_sync(self.model, i == len(batches) - 1)
            loss_sum += self.forward_backward(batch, global_count)
        self.faults.after_backward(self.model)
        grad_norm = clip_grad_norm(self.model, self.cfg.optim.grad_clip)
        # Every rank reaches the same verdict (one all-reduce): apply, or skip on all ranks together.
        verdict = self.guard.check(self.step + 1, loss_sum.item(), grad_norm, counts.label_tokens)
        lr = self.optimizer_step(apply=verdict.skip is None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step += 1
        metrics = StepMetrics.measure(
            counts, step=self.step, epoch=self.sampler.epoch, loss_sum=verdict.loss_sum, lr=lr, grad_norm=grad_norm,
            skipped=verdict.skip, step_time_s=time.perf_counter() - start, peak_mem_gib=peak_memory_gib(self.device),
            model_flops=model_flops(counts.tokens, counts.sum_squared_lengths, self.flop_params),
            tokens_seen_before=self.tokens_seen, cp_skew=cp_skew, preference=self.step_preference_metrics(counts),
        )
        self.tokens_seen = metrics.tokens_seen
        return metrics

    def step_preference_metrics(self, counts: StepCounts) -> dict[str, float] | None:
        """``objective=dpo``: the step's TRL-named metrics over every rank (one all-reduce)."""
        if self.objective is None:
            return None
        return preference_metrics(distributed.all_reduce_sum(self.pair_sums.tolist(), self.device), counts.pairs)

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
        log.warning("%s received: stopped after step %d with checkpoint %s; resume=auto continues from there",
                    stop_signal, self.step, self.last_checkpoint)
        self.metrics.close()
        self.owner.release()
        return {"preempted": stop_signal, "step": self.step, "checkpoint": str(self.last_checkpoint),
                "run_dir": str(self.run_dir)}

    def evaluate(self) -> EvalMetrics | None:
        """Eval loss on the held-out split (packed batches; every rank takes part; under cp, sharded rows)."""
        if self.eval_dataset is None:
            return None
        # pairs: cp>1 is refused at build
        run = partial(evaluate, cp=self.cp, cp_split=self.cfg.parallel.cp_split) if self.objective is None \
            else self.objective.evaluate
        result = EvalMetrics(step=self.step, **run(
            self.model, self.eval_dataset, self.cfg.row_budget, self.device, self.tokenizer.pad_token_id
        ))
        self.summary.add_eval(result)
        self.metrics.log_eval(result)
        return result

    def finish(self) -> dict:
        result = self.summary.result(self.peak_tflops * self.world_size) | {
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
            "unigram_entropy": unigram_entropy(self.dataset.label_token_counts())  # a stream has no whole set
            if hasattr(self.dataset, "label_token_counts") else float("nan"),
            "skipped_steps": dict(self.guard.skipped),
            "run_dir": str(self.run_dir),
        } | self.metrics.wall_clock()
        self.metrics.close()
        self.owner.release()
        if self.rank == 0:
            (self.run_dir / SUMMARY_FILE).write_text(json.dumps(json_safe(result), indent=2))
            mfu = f"MFU {100 * result['mfu']:.2f}% | " if math.isfinite(result["mfu"]) else ""  # no peak: no MFU
            log.info(
                "RESULT %s (%s): useful tokens/s %.0f | padding %.1f%% | final loss %.4f | eval loss %.4f | "
                "%s%d steps on %d rank(s)",
                result["mode"], result["strategy"], result["useful_tokens_per_s"],
                100 * result["padding_fraction"], result["final_loss"], result["final_eval_loss"],
                mfu, result["steps"], self.world_size,
            )
        return result


def whole_pairs(indices: np.ndarray, lengths: np.ndarray, budget: int) -> np.ndarray:
    """The self-check batch for preference pairs: the examples of its pieces (or rows), whole, in order,
    those that fit ``budget`` together (the longest pair always does)."""
    chosen, room = [], budget
    for i in dict.fromkeys(int(v) for v in (indices[:, 0] if indices.ndim == 2 else indices)):
        if lengths[i] <= room or not chosen:
            chosen.append(i)
            room -= int(lengths[i])
    return np.array(chosen, dtype=np.int64)


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
