"""The run directory: where a job's config, metrics and checkpoints go, agreed on by every rank."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from trainer import distributed
from trainer.config import JobConfig
from trainer.safety import redact_tree

log = logging.getLogger("trainer")


def agree_run_dir(cfg: JobConfig) -> Path:
    """Rank 0 picks the run directory (``run_dir`` or ``<output_root>/<name>/<timestamp>``) and every rank
    takes it from there, so ranks started in different seconds never disagree.

    A torchrun restart (``--max-restarts``) starts fresh processes in a later second; they must find the
    checkpoints of the attempt they replace. Torchrun gives every attempt of one job the same rendezvous id
    (``TORCHELASTIC_RUN_ID``: ``--rdzv-id``, or a random id per ``--standalone`` launch), so rank 0 records
    the directory it chose under that id and a restarted attempt takes it from there."""
    chosen = None
    if distributed.is_rank0():
        job = multirun_job_tag()
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        marker = Path(cfg.output_root) / cfg.name / ".by_run_id" / run_id if run_id != "none" and not job else None
        if cfg.run_dir:
            chosen = Path(cfg.run_dir) / job if job else Path(cfg.run_dir)
        elif marker is not None and marker.is_file():
            chosen = Path(marker.read_text().strip())
            log.info("torchrun attempt %s of run %s: reusing %s",
                     os.environ.get("TORCHELASTIC_RESTART_COUNT", "?"), run_id, chosen)
        else:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S") + (f"-{job}" if job else "")
            chosen = Path(cfg.output_root) / cfg.name / stamp
            suffix = 1
            while chosen.exists():
                chosen = Path(cfg.output_root) / cfg.name / f"{stamp}-{suffix}"
                suffix += 1
            if marker is not None:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(str(chosen))
        chosen.mkdir(parents=True, exist_ok=True)
        (chosen / "config.yaml").write_text(OmegaConf.to_yaml(redact_tree(asdict(cfg))))
    return Path(distributed.broadcast_object(str(chosen) if chosen else None))


def multirun_job_tag() -> str:
    """In a Hydra multirun (``-m``): ``<job number>-<its overrides>``, so every job of a sweep gets its own
    run directory that says what it ran; ``""`` otherwise."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return ""
    job = HydraConfig.get().job
    overrides = "".join(c if c.isalnum() or c in "=.,-_+" else "_" for c in job.override_dirname)
    return f"{job.num}-{overrides}"[:120]
