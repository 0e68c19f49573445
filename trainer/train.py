"""Train a recipe: ``torchrun --nproc_per_node N -m trainer.train recipe=NAME key=value ...``

The command-line entry. It checks the command line before anything heavy is imported (a wrong group option
or config value fails in a fraction of a second with one line), then hands the validated ``JobConfig`` to
``trainer.loop.Trainer`` and turns any failure into one line per rank (``trainer.guard``).
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from trainer.cli import check_code_sources, check_group_choices, check_overrides
from trainer.compose import config_dir, open_mapping_overrides, register_configs, to_job_config
from trainer.config import ConfigError, JobConfig
from trainer.safety import printable, redact
from trainer.stop_signals import (
    PREEMPTED_EXIT_CODE,
    Interrupted,
    exit_interrupted,
    signals_interrupt,
    stop_with_launcher,
)

log = logging.getLogger("trainer")


def run(cfg: JobConfig, keep_process_group: bool = False) -> dict:
    """Train one job. ``keep_process_group``: the jobs of a multirun sweep share one process group (torn
    down at exit): re-creating it under torchrun makes rank 0 host a second store on the port its first
    one held, and the ranks hang in the rendezvous. Any failure becomes a ``JobFailed`` with one line for
    this rank (see ``trainer.guard``).

    No teardown barrier after an error: the other ranks may be blocked in a collective this rank will never
    join, so a barrier would hang both until the timeout. Exiting lets torchrun stop the job (or restart
    it, with --max-restarts) at once."""
    # Heavy (torch, transformers): imported here, after the command line's checks, which answer without them.
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415 -- heavy: after the command line's checks (above)

    from trainer import distributed  # noqa: PLC0415 -- heavy: after the command line's checks (above)
    from trainer.guard import describe_failure  # noqa: PLC0415 -- heavy: after the command line's checks (above)
    from trainer.loop import Trainer  # noqa: PLC0415 -- heavy: after the command line's checks (above)

    trainer = None
    try:
        with signals_interrupt(setup_interrupted_line):  # one line and exit 75, not a traceback
            trainer = Trainer(cfg)
        with signals_interrupt(outside_step_line):  # inside the loop, its step boundary takes them
            result = trainer.train()
    except Interrupted as e:
        interrupted(e)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        where = f"step {trainer.step + 1}" if trainer is not None else "setup"
        raise describe_failure(e, where, cfg.guard.collective_timeout_s) from e
    if result.get("preempted"):  # before the teardown's barrier: every rank's line is out before any exits
        announce_preempted(result)
    try:  # a signal now (torchrun stops the others once one rank exits): exit 75, its line is out already
        with signals_interrupt((lambda name: "") if result.get("preempted") else outside_step_line):
            if keep_process_group:
                distributed.barrier()  # every rank finishes this job before any starts the next
            else:
                distributed.destroy_distributed()
    except Interrupted as e:
        interrupted(e)
    return result


@hydra.main(config_path=str(config_dir()), config_name="config", version_base=None)
def hydra_main(raw: DictConfig) -> dict | None:
    # Heavy (torch): imported once the command line is checked, as in ``run``.
    from trainer import distributed  # noqa: PLC0415 -- heavy: after the command line's checks (above)
    from trainer.guard import JobFailed  # noqa: PLC0415 -- heavy: after the command line's checks (above)
    from trainer.run_dir import multirun_job_tag, redact_sweep_file  # noqa: PLC0415 -- heavy: after the command line's checks (above)

    try:
        cfg = to_job_config(raw)
        cfg.validate_world(distributed.world_size())  # from WORLD_SIZE: before any process group exists
    except ConfigError as e:
        print(f"packfsdp: config error: {printable(redact(str(e)))}", file=sys.stderr)
        sys.exit(2)
    multirun = bool(multirun_job_tag())
    if multirun:
        atexit.register(distributed.destroy_distributed)  # idempotent; after the sweep's last job
        if distributed.is_rank0():
            redact_sweep_file()
    try:
        result = run(cfg, keep_process_group=multirun)
    except JobFailed as e:
        if e.own and e.exit_code == 1:  # this rank's own unexpected error: its traceback helps
            log.error("failed", exc_info=e.__cause__)
        sys.stderr.write(f"packfsdp: {e}\n")  # one write: ranks share the pipe, print() would interleave
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's failure summary shows this line, not a trace
            record = {"message": str(e), "extraInfo": {"py_callstack": str(e), "timestamp": str(int(time.time()))}}
            Path(os.environ["TORCHELASTIC_ERROR_FILE"]).write_text(json.dumps({"message": record}))
        sys.stdout.flush()
        sys.stderr.flush()
        if e.together:  # let every rank print its line before the first exit makes torchrun stop the rest
            distributed.store_barrier("failed", timeout_s=10)
        # No collective and no process-group destructor: either could wait forever on a dead or stuck peer.
        os._exit(e.exit_code)
    if result.get("preempted"):
        exit_preempted(result)
    return result


def announce_preempted(result: dict) -> None:
    """A run stopped by SIGTERM/SIGUSR1 after its checkpoint: one line per rank. Written while the process
    group is up, before the teardown's barrier: the first rank to exit makes torchrun SIGTERM the others,
    which must have written theirs by then."""
    from trainer import distributed  # noqa: PLC0415 -- heavy (torch): loaded by then; the command line's checks never get here

    sys.stderr.write(
        f"packfsdp: rank {distributed.rank()}: preempted ({result['preempted']}) after step {result['step']}: "
        f"checkpoint {result['checkpoint']} saved; run again with resume=auto to continue "
        f"(exit code {PREEMPTED_EXIT_CODE})\n"
    )
    sys.stderr.flush()


def setup_interrupted_line(signal_name: str) -> str:
    """A stop signal during setup (before Hydra, the tokenizer, the data, the model, the verdict, the
    self-check, the DPO reference): no step was trained since the last checkpoint, nothing to save."""
    return (
        f"packfsdp: rank {_rank()}: preempted ({signal_name}) during setup, before any step was trained; "
        f"nothing to save: run again with resume=auto (exit code {PREEMPTED_EXIT_CODE})"
    )


def outside_step_line(signal_name: str) -> str:
    """A stop signal in the moments before the loop's first step or after its last boundary."""
    return (
        f"packfsdp: rank {_rank()}: preempted ({signal_name}) outside a step; nothing trained since the last "
        f"checkpoint: run again with resume=auto (exit code {PREEMPTED_EXIT_CODE})"
    )


def interrupted(e: Interrupted) -> None:
    """One line and ``PREEMPTED_EXIT_CODE`` (no collective: the other ranks may be anywhere in setup)."""
    sys.stdout.flush()
    sys.stderr.flush()
    exit_interrupted(e.line)


def _rank() -> int:
    """This process's rank (from torchrun's environment before the process group starts)."""
    return int(os.environ.get("RANK", 0))


def exit_preempted(result: dict) -> None:
    """Exit with ``PREEMPTED_EXIT_CODE`` (the line was written by ``announce_preempted``)."""
    sys.exit(PREEMPTED_EXIT_CODE)


def main() -> None:
    # Registered first, so it runs after every other exit handler (logs flushed, process group torn down): the
    # interpreter's final garbage collections then skip the millions of objects torch and transformers hold,
    # which took 1.5-4 s per rank at every exit on a busy machine; nothing left is collected that needs a finaliser.
    atexit.register(gc.freeze)
    stop_with_launcher()  # under torchrun: a worker never outlives its agent
    try:
        with signals_interrupt(setup_interrupted_line):  # from the first line, not from the Trainer's
            register_configs()
            sys.argv[1:] = open_mapping_overrides(sys.argv[1:])  # before Hydra reads them
            check_group_choices(sys.argv[1:])
            check_overrides(sys.argv[1:])
            check_code_sources(sys.argv[1:])  # before Hydra instantiates its callbacks, launcher and sweeper
            hydra_main()
    except Interrupted as e:
        interrupted(e)


if __name__ == "__main__":
    main()
