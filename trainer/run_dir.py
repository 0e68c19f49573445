"""The run directory: where a job's config, metrics and checkpoints go, agreed on by every rank and owned by
one run.

Ownership (``claim_run_dir``):

- ``run.json`` names the run that lives in the directory (a random run id). Checkpoints carry it, and
  ``resume=auto`` and pruning only consider the checkpoints of this run.
- A new run (``resume=none``) into a directory that already holds a run is refused with one line: it would
  mix two runs' metrics and checkpoints. ``resume=auto`` (or a path) continues the run that is there; a
  torchrun restart of the same job continues it too, recognised by ``job_token`` (the torchrun agent this
  very job runs under: host, pid and start time), never by a reusable name such as ``--rdzv-id``.
- A directory holding files packfsdp did not write (no ``run.json``) is refused, and so is a file packfsdp
  writes there that is a symlink: packfsdp never writes through a link it did not create.
- ``.lock`` (host, pid, job token) refuses a second run while one is using the directory. A lock is
  stale, and taken over, when its process is gone (same host) or it was left by an earlier attempt of this
  very job (a torchrun restart: same job token; a SLURM requeue: same ``SLURM_JOB_ID``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from trainer import distributed
from trainer.config import ConfigError, JobConfig
from trainer.safety import redact_argv, redact_tree

log = logging.getLogger("trainer")


RUN_FILE = "run.json"
LOCK_FILE = ".lock"
PREVIOUS_RUN_SIGNS = (RUN_FILE, "metrics.jsonl", "checkpoints")
"""Files a run leaves in its directory: any of them means the directory already holds a run."""
WRITTEN_HERE = (RUN_FILE, LOCK_FILE, "config.yaml", "metrics.jsonl", "eval.jsonl", "summary.json", "checkpoints")
"""What packfsdp writes in a run dir; none of them may be a symlink (it never creates one)."""


def job_token() -> str:
    """This job's restart token: the torchrun agent (the workers' parent) as host:pid:start time. Every
    attempt of one torchrun job runs under the same agent; a new launch, even with a reused ``--rdzv-id``,
    has another. ``"none"`` outside torchrun."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return "none"
    agent = os.getppid()
    return f"{socket.gethostname()}:{agent}:{_process_start(agent)}"


class RunDirError(ConfigError):
    """The run directory belongs to another run, or is in use (fix the command: exit code 2)."""


@dataclass
class RunDir:
    path: Path
    run_id: str
    """The run living in ``path`` (from ``run.json``); checkpoints carry it."""

    def release(self) -> None:
        """Remove this process's lock (rank 0; at the end of a run or after a preemption checkpoint)."""
        lock = self.path / LOCK_FILE
        if distributed.is_rank0() and _read_json(lock).get("pid") == os.getpid():
            lock.unlink(missing_ok=True)


def claim_run_dir(cfg: JobConfig) -> RunDir:
    """The agreed run directory, locked and owned (see the module doc); refusals fail on every rank."""
    owner: list[RunDir] = []

    def claim() -> None:
        path = choose_run_dir(cfg)
        refuse_links(path)
        refuse_foreign(path)
        take_lock(path)
        try:
            owner.append(RunDir(path, own_run_id(path, cfg.resume)))
        except RunDirError:
            (path / LOCK_FILE).unlink(missing_ok=True)  # refused: the directory stays as it was
            raise
        (path / "config.yaml").write_text(OmegaConf.to_yaml(redact_tree(asdict(cfg))))

    distributed.on_rank0_then_all(claim)
    path, run_id = distributed.broadcast_object((str(owner[0].path), owner[0].run_id) if owner else None)
    return RunDir(Path(path), run_id)


def refuse_links(path: Path) -> None:
    """Refuse a run dir where a file packfsdp writes is a symlink (its target would be overwritten)."""
    links = [name for name in WRITTEN_HERE if (path / name).is_symlink()]
    if links:
        raise RunDirError(
            f"run_dir {path}: {', '.join(links)} is a symlink packfsdp did not create; packfsdp never writes "
            "through one (remove it, or give a new run_dir)"
        )


def refuse_foreign(path: Path) -> None:
    """Refuse a folder holding files packfsdp did not write: without ``run.json`` it must be empty (a
    ``.lock`` left by a start that was refused is packfsdp's)."""
    if (path / RUN_FILE).is_file():
        return
    foreign = sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE and not p.name.startswith(".lock."))
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise RunDirError(
            f"run_dir {path} holds files packfsdp did not write ({shown}); give an empty or new run_dir "
            "(packfsdp never overwrites what it did not write)"
        )


def own_run_id(path: Path, resume: str) -> str:
    """The run id of ``path``: the recorded one when this start continues it, a new one for a new run."""
    job = job_token()
    recorded = _read_json(path / RUN_FILE)
    restart = job != "none" and recorded.get("job_token") == job
    if recorded.get("run_id") and (resume not in ("none", "") or restart):
        return recorded["run_id"]
    previous = [name for name in PREVIOUS_RUN_SIGNS if (path / name).exists()]
    if previous and resume in ("none", ""):
        raise RunDirError(
            f"run_dir {path} already holds a run ({', '.join(previous)}); add resume=auto to continue it, "
            "or give a new run_dir"
        )
    run_id = uuid.uuid4().hex[:12]
    (path / RUN_FILE).write_text(
        json.dumps({"run_id": run_id, "job_token": job, "created": datetime.now().isoformat()})
    )
    return run_id


def take_lock(path: Path) -> None:
    """Create ``<path>/.lock`` for this process, taking over a stale one; refuse a live one."""
    lock = path / LOCK_FILE
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": _process_start(os.getpid()),
        "job_token": job_token(),
        "slurm_job": os.environ.get("SLURM_JOB_ID", ""),
        "since": datetime.now().isoformat(),
    }
    try:  # no lock yet: create it exclusively, so two runs starting at once cannot both get it
        with os.fdopen(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY), "w") as f:
            f.write(json.dumps(me))
        return
    except FileExistsError:
        pass
    held = _read_json(lock)
    if not _stale(held, me):
        raise RunDirError(
            f"run_dir {path} is in use by pid {held.get('pid')} on {held.get('host')} since {held.get('since')}; "
            f"wait for that run to end, or delete {lock} if it is no longer running"
        )
    log.info("taking over the stale lock of pid %s on %s (%s)", held.get("pid"), held.get("host"), lock)
    tmp = lock.with_name(f"{LOCK_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps(me))
    os.replace(tmp, lock)


def _stale(held: dict, me: dict) -> bool:
    """An earlier attempt of this job, or a process that is gone (same host: the pid and its start time)."""
    if not held.get("pid"):  # unreadable or empty: its writer died between creating and writing it
        return True
    if held.get("job_token") not in (None, "none") and held.get("job_token") == me["job_token"]:
        return True
    if held.get("slurm_job") and held.get("slurm_job") == me["slurm_job"]:  # a requeue of this SLURM job
        return True
    if held.get("host") != me["host"]:
        return False
    pid = held.get("pid")
    if pid == me["pid"]:  # an earlier job of this process (a multirun sweep, a test) that did not release it
        return True
    return not isinstance(pid, int) or _process_start(pid) is None or _process_start(pid) != held.get("started")


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (Linux ``/proc``; the pid alone may be reused), or ``None`` if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "unknown"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def choose_run_dir(cfg: JobConfig) -> Path:
    """Rank 0 picks the run directory (``run_dir`` or ``<output_root>/<name>/<timestamp>``) and every rank
    takes it from there (``claim_run_dir``), so ranks started in different seconds never disagree.

    A torchrun restart (``--max-restarts``) starts fresh processes in a later second; they must find the
    checkpoints of the attempt they replace. Torchrun gives every attempt of one job the same rendezvous id
    (``TORCHELASTIC_RUN_ID``: ``--rdzv-id``, or a random id per ``--standalone`` launch), so rank 0 records
    the directory it chose under that id and a restarted attempt takes it from there."""
    job = multirun_job_tag()
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    token = job_token()
    marker = (
        Path(cfg.output_root).expanduser() / cfg.name / ".by_run_id" / run_id if run_id != "none" and not job else None
    )
    recorded = _read_json(marker) if marker is not None and not marker.is_symlink() else {}
    if cfg.run_dir:
        chosen = Path(cfg.run_dir).expanduser() / job if job else Path(cfg.run_dir).expanduser()
    elif recorded.get("job_token") == token and recorded.get("dir"):  # an attempt of this very job, not a reused id
        chosen = Path(recorded["dir"])
        log.info(
            "torchrun attempt %s of run %s: reusing %s",
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "?"),
            run_id,
            chosen,
        )
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S") + (f"-{job}" if job else "")
        chosen = Path(cfg.output_root).expanduser() / cfg.name / stamp
        suffix = 1
        while chosen.exists():
            chosen = Path(cfg.output_root).expanduser() / cfg.name / f"{stamp}-{suffix}"
            suffix += 1
        if marker is not None:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.unlink(missing_ok=True)  # never written through a link
            marker.write_text(json.dumps({"dir": str(chosen), "job_token": token}))
    chosen.mkdir(parents=True, exist_ok=True)
    return chosen


def multirun_job_tag() -> str:
    """In a Hydra multirun (``-m``): ``<job number>-<its overrides>``, so every job of a sweep gets its own
    run directory that says what it ran (a secret-named key's value as ``***``); ``""`` otherwise."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return ""
    hydra_cfg = HydraConfig.get()
    overrides = ",".join(sorted(redact_argv(list(hydra_cfg.overrides.task))))
    overrides = "".join(c if c.isalnum() or c in "=.,-_+*" else "_" for c in overrides).replace("***", "redacted")
    return f"{hydra_cfg.job.num}-{overrides}"[:120]


def redact_sweep_file() -> None:
    """Rewrite the sweep's ``multirun.yaml`` (Hydra writes the overrides and config there as given) with
    secrets redacted; every job of the sweep calls it, the first one does the work."""
    path = Path(HydraConfig.get().sweep.dir) / "multirun.yaml"
    if not path.is_file():
        return
    saved = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    clean = redact_tree(saved)
    if clean != saved:
        tmp = path.with_name(f"multirun.yaml.{os.getpid()}")
        tmp.write_text(OmegaConf.to_yaml(clean))
        os.replace(tmp, path)
