"""Issue 33, cases 3 and 4: a stop signal is answered in every phase, native code included; no worker outlives
its torchrun agent; a stopped rank ends the others within ``guard.collective_timeout_s`` under context
parallelism too, naming the step and the rank. Real torchrun jobs (2 gloo ranks) but for the first test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, wait_until
from tests.faults.conftest import SMALL_RUN, one_rank_world
from trainer.stop_signals import PREEMPTED_EXIT_CODE


def test_every_group_made_after_the_start_honours_the_collective_timeout():
    """A group made without a timeout of its own (context parallelism's, DeviceMesh's HSDP dimensions) waited
    torch's default, 30 min on gloo: a stopped rank under cp=2 hung the other (case 3)."""
    import torch.distributed as dist

    from trainer import distributed
    from trainer.config import ParallelConfig
    from trainer.parallel import build_mesh
    from trainer.parallel.route import new_cp_group

    def timeout_s(group) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    with one_rank_world():
        distributed.init_distributed(torch.device("cpu"), "gloo", timeout_s=7)
        mesh = build_mesh(torch.device("cpu"), 1, ParallelConfig(dp_replicate=1))
        groups = [dist.new_group([0]), mesh.get_group("dp_replicate"), mesh.get_group("dp_shard")]
        assert new_cp_group(1, 1, 0) is None  # cp=2 makes its groups with dist.new_group, as the first one here
        assert [timeout_s(g) for g in groups] == [7, 7, 7]


def _torchrun(args: list[str], env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    full_env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | env
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _all_gone(pids: list[int], within_s: float = 30.0) -> bool:
    """True once no worker is alive (fails otherwise). Their shared pipe closes a moment before the kernel marks
    them exited (files are released before the exit is signalled), so a loaded machine can see one still
    running: polled, not checked once."""
    return wait_until(lambda: not any(_alive(pid) for pid in pids), within_s, what="every worker exited")


def _pids(pidfile: Path) -> list[int]:
    """The workers' pids, once both wrote theirs (atomically: signal_entry.py writes a temp file, then
    os.replace, so a file that exists holds a whole pid); polled, as torchrun starts them asynchronously."""
    found = [Path(f"{pidfile}.{r}") for r in (0, 1)]
    wait_until(lambda: all(f.is_file() for f in found), 120, 0.2, what="the workers' pid files")
    return [int(f.read_text()) for f in found]


def _kill(proc: subprocess.Popen, pids: list[int]) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.communicate()


@pytest.mark.slow
def test_sigterm_while_the_tokenizer_trains_in_native_code_is_one_line_per_rank_and_exit_75(tmp_path):
    """Case 4: rank 0 inside the tokenizers trainer (native, minutes), rank 1 waiting for it in a gloo
    broadcast (native too): neither ran its Python handler, torchrun SIGKILLed them 30 s later, no line."""
    proc = _torchrun(
        [
            "-m",
            "tests.faults.signal_entry",
            *SMALL_RUN,
            f"run_dir={tmp_path / 'run'}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        {"PFTEST_SIGNAL": "SIGTERM:native:0:0", "PFTEST_PIDFILE": str(tmp_path / "pid")},
    )
    pids = _pids(tmp_path / "pid")
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        _kill(proc, pids)
        raise AssertionError("the ranks did not stop") from None
    lines = sorted(line for line in out.splitlines() if line.startswith("packfsdp: rank"))
    assert [line[:40] for line in lines] == [
        "packfsdp: rank 0: preempted (SIGTERM) du",
        "packfsdp: rank 1: preempted (SIGTERM) du",
    ], out[-3000:]
    assert all(
        f"during setup, before any step was trained; nothing to save: run again with resume=auto (exit code "
        f"{PREEMPTED_EXIT_CODE})" in line
        for line in lines
    )
    assert _all_gone(pids)


@pytest.mark.slow
def test_workers_stop_with_a_checkpoint_when_their_torchrun_agent_is_killed(tmp_path):
    """Case 4: SIGKILL of the agent at step 2 left both workers training unsupervised (2 -> 10 logged steps in
    60 s). Now the agent's death reaches them as SIGTERM: they stop at the next boundary, with a checkpoint."""
    run = tmp_path / "run"
    proc = _torchrun(
        [
            "-m",
            "tests.faults.signal_entry",
            *SMALL_RUN,
            "max_steps=100000",
            f"run_dir={run}",
            "checkpoint.every_steps=0",
            "checkpoint.every_minutes=0",
        ],
        {"PFTEST_PIDFILE": str(tmp_path / "pid")},
    )
    pids = _pids(tmp_path / "pid")

    def step_2_logged() -> bool:  # polled: the steps come at the workers' pace, slower on a loaded machine
        assert proc.poll() is None, "the job ended before step 2"
        metrics = run / "metrics.jsonl"
        return metrics.is_file() and len(metrics.read_text().splitlines()) >= 2

    wait_until(step_2_logged, 180, 0.1, what="step 2 in metrics.jsonl")
    os.kill(proc.pid, signal.SIGKILL)  # the agent, not its workers
    try:
        out, _ = proc.communicate(timeout=60)  # the workers hold the pipe: it ends when they have exited
    except subprocess.TimeoutExpired:
        _kill(proc, pids)
        raise AssertionError("the workers outlived their agent") from None
    assert _all_gone(pids)
    lines = [line for line in out.splitlines() if line.startswith("packfsdp: rank")]
    assert len(lines) == 2 and all("preempted (SIGTERM) after step" in line for line in lines), out[-3000:]
    step = int(lines[0].split("after step ")[1].split(":")[0])
    assert (run / "checkpoints" / f"step_{step:08d}").is_dir()
    assert len((run / "metrics.jsonl").read_text().splitlines()) == step


@pytest.mark.slow
def test_a_stopped_rank_under_context_parallelism_ends_the_other_naming_the_step_and_the_rank(tmp_path):
    """Case 3: SIGSTOP of rank 1 inside attention (its context-parallel all-gather) at step 3: rank 0 waited in
    the CP group's all-gather, made without the timeout (30 min), no line. Now it fails after 5 s."""
    proc = _torchrun(
        [
            "-m",
            "tests.faults.signal_entry",
            "recipe=cpu_long_context",
            "data.num_records=120",
            "max_steps=4",
            "guard.collective_timeout_s=5",
            f"run_dir={tmp_path / 'run'}",
        ],
        {"PFTEST_SIGNAL": "SIGSTOP:cp_gather:1:3", "PFTEST_PIDFILE": str(tmp_path / "pid")},
    )
    pids = _pids(tmp_path / "pid")
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(proc.stdout), daemon=True).start()

    def rank0_line() -> str | None:
        return next((x for x in list(seen) if x.startswith("packfsdp: rank 0:")), None)

    try:  # polled: the line comes after the collective timeout, at the job's pace (slower under load)
        wait_until(lambda: rank0_line() or proc.poll() is not None, 150, 0.2, what="rank 0's line or the job's end")
    except pytest.fail.Exception:
        pass  # the workers are woken and ended below; the assertion on the line then shows the output
    line = rank0_line()
    os.kill(pids[1], signal.SIGCONT)  # woken, it finds its peer gone and exits too
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait()
    assert line, "".join(seen)[-3000:]
    assert line.startswith(
        "packfsdp: rank 0: a collective failed at step 3 (guard.collective_timeout_s=5): rank 1: no heartbeat for"
    ), line
    assert ", in step 3;" in line


EXPORT_SIGNALLED = """
import os, signal, sys
from trainer.tools import export

real = export.AutoTokenizer


class SignalledTokenizer:  # SIGTERM arrives while the export writes its files
    @staticmethod
    def from_pretrained(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real.from_pretrained(*args, **kwargs)


export.AutoTokenizer = SignalledTokenizer
export.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_sigterm_during_an_export_is_one_line_and_exit_75_leaving_nothing_half_written(finished_run, tmp_path):
    """The export phase: SIGTERM killed it (no line, exit -15) and left the half-written ``.out.export-PID``."""
    out = tmp_path / "exported"
    proc = subprocess.run(
        [sys.executable, "-c", EXPORT_SIGNALLED, f"checkpoint={finished_run}", f"out={out}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == PREEMPTED_EXIT_CODE, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        f"packfsdp export: stopped by SIGTERM; {out} left as it was: run the "
        f"export again (exit code {PREEMPTED_EXIT_CODE})"
    )
    assert list(tmp_path.iterdir()) == []  # neither out nor a half-written copy beside it
