"""Process-group plumbing: start/stop, rank queries, and the few collectives the loop needs.

Every helper works without a process group (a plain ``python`` run): rank 0 of world 1.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

log = logging.getLogger(__name__)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_rank0() -> bool:
    return rank() == 0


def resolve_device(device: str) -> torch.device:
    """``auto`` -> this rank's CUDA device when CUDA is available, else CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("parallel.device=cuda but CUDA is not available here; use parallel.device=cpu")
        torch.cuda.set_device(local_rank())
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_group_backend(device: torch.device, backend: str = "auto", cpu_offload: bool = False) -> str:
    """The ``init_process_group`` backend: ``auto`` is nccl on CUDA, gloo on CPU.

    With CPU offload on CUDA, FSDP keeps the gradients on the host and ``clip_grad_norm_`` all-reduces their
    norms there; an NCCL-only group has no backend for CPU tensors ("No backend type associated with device
    type cpu"), so such a run gets ``cuda:nccl,cpu:gloo``: NCCL for CUDA tensors, gloo for CPU ones (as
    torchtitan does).
    """
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise RuntimeError("parallel.backend=nccl needs CUDA; use parallel.backend=gloo on CPU")
    if backend == "nccl" and cpu_offload:
        return "cuda:nccl,cpu:gloo"
    return backend


def init_distributed(
    device: torch.device, backend: str = "auto", timeout_s: float = 600.0, cpu_offload: bool = False
) -> None:
    """Start the default process group (a world of 1 when not launched by torchrun)."""
    if is_initialized():
        return
    backend = process_group_backend(device, backend, cpu_offload)
    if "RANK" not in os.environ:  # plain `python -m trainer.train`: a single-rank group
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    # A group created later without a timeout of its own (a context-parallel group, DeviceMesh's HSDP
    # dimensions, any library's) would wait torch's default (30 min gloo, 10 min NCCL) for a stopped peer:
    # torch reads these two names whenever it makes such a group, so every one honours the timeout too.
    distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = timeout
    start_heartbeat(heartbeat_interval(timeout_s))


def destroy_distributed(clean: bool = True) -> None:
    """Tear the group down together: a rank that leaves while another still talks aborts gloo.

    ``clean=False`` (after a failure) skips the final barrier: the other ranks may be gone or stuck, and
    waiting for them would turn one rank's error into a hang.
    """
    if is_initialized():
        stop_heartbeat()
        if clean:
            dist.barrier()
        # The model (FSDP state), device mesh and optimizer hold the group through reference cycles. Collect
        # them now, while the interpreter is fully alive: left to interpreter finalisation, gloo's worker
        # threads are torn down mid-exit and the process aborts ("terminate called without an active
        # exception") after a run that had finished.
        gc.collect()
        dist.destroy_process_group()


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few scalars over all ranks in one collective (float64, exact for token counts)."""
    if not is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    if not is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def on_rank0_then_all(fn: Callable[[], None]) -> None:
    """Run ``fn`` on rank 0 while the other ranks wait (e.g. build a cache every rank then reads).

    An error on rank 0 is raised on every rank, so a bad data path fails everywhere with the same message
    instead of rank 0 exiting while the others wait in a barrier or read a file that was never written.
    """
    error = None
    if is_rank0():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- re-raised below, on every rank
            error = e
    try:
        shared = broadcast_object(error)
    except Exception:  # noqa: BLE001 -- an exception that does not pickle: send its text
        shared = broadcast_object(RuntimeError(f"on rank 0: {type(error).__name__}: {error}") if error else None)
    if error is not None:
        raise error
    if shared is not None:
        raise shared


def check_same_on_all_ranks(values: dict[str, int], device: torch.device) -> None:
    """Fail on every rank, together, unless each named value is equal on all ranks (one all-reduce).

    Used for the dataset size and the number of optimizer steps: a rank that ran out of data before the
    others (a stale cache on one node, a sampler bug) would leave them waiting in a collective forever, so
    a disagreement is an error before the first step, never a hang.
    """
    names = list(values)
    flat = [float(values[n]) for n in names] + [-float(values[n]) for n in names]
    reduced = all_reduce_max(flat, device)
    for i, name in enumerate(names):
        high, low = reduced[i], -reduced[len(names) + i]
        if high != low:
            raise RuntimeError(
                f"ranks disagree on {name}: between {int(low)} and {int(high)} (this rank: {values[name]}); "
                "every rank must see the same data"
            )


# The c10d store every rank already shares: a failing rank leaves its reason there, so the ranks that only
# see a broken collective can say *why* the job stopped.
_FAILURE_KEY = "packfsdp/failure/{rank}"


def record_failure(message: str) -> None:
    """Leave this rank's failure reason in the shared store (best effort: the store may be gone)."""
    if not is_initialized():
        return
    try:
        failure_store().set(_FAILURE_KEY.format(rank=rank()), message)
    except Exception:  # noqa: BLE001 - reporting must never raise over the real error
        pass


def peer_failures() -> dict[int, str]:
    """Failure reasons other ranks recorded (best effort, never blocks: ``check`` before ``get``)."""
    if not is_initialized():
        return {}
    found = {}
    try:
        store = failure_store()
        for r in range(world_size()):
            key = _FAILURE_KEY.format(rank=r)
            if r != rank() and store.check([key]):
                found[r] = store.get(key).decode(errors="replace")
    except Exception:  # noqa: BLE001
        pass
    return found


def failure_store(wait_s: float = 2.0):
    """The shared store, for a failing rank: each operation waits at most ``wait_s`` (the store may live in a
    stopped rank's process, and the collective timeout has already been waited once). This rank's heartbeat
    stops: its failure is what it tells the others now."""
    stop_heartbeat()
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(datetime.timedelta(seconds=wait_s))
    return store


def store_barrier(name: str, timeout_s: float) -> bool:
    """Wait (at most ``timeout_s``) until every rank reached ``name``, through the c10d store rather than a
    collective, so it works while collectives are broken. Best effort: ``False`` on timeout or no store.

    Used before exiting on a failure every rank reaches together: the first rank to exit makes torchrun
    stop the others, which must have printed their own line by then.
    """
    if not is_initialized() or world_size() == 1:
        return True
    try:
        store = dist.distributed_c10d._get_default_store()
        key = f"packfsdp/barrier/{name}"
        store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(key, 0) < world_size():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True
    except Exception:  # noqa: BLE001
        return False


# Heartbeats: which rank stopped answering. A rank stuck in a collective only sees "timed out"; every rank's
# thread leaves the time and the step it is in under its key, so the ranks that give up can name the one whose
# heartbeat went quiet (stopped, frozen, dead) or that never started their step (hung before it). The stamps
# are wall-clock times: hosts' clocks must agree within a second or so (NTP), far below the staleness bound.
_HEARTBEAT_KEY = "packfsdp/alive/{rank}"
_progress = {"step": 0}
_stepped = threading.Event()
_quiet = threading.Event()
"""Set at teardown and on failure: the store may go with rank 0 (or the agent), and a write to a store that is
gone costs a C++ warning with a stack trace on stderr."""


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between heartbeats: a tenth of the collective timeout, within [0.5, 10] (one small store write)."""
    return min(10.0, max(0.5, timeout_s / 10))


def note_step(step: int) -> None:
    """The optimizer step this rank is in (its heartbeat carries it, written at once)."""
    _progress["step"] = step
    _stepped.set()


def start_heartbeat(interval_s: float) -> None:
    """A daemon thread writing ``"<time> <step>"`` under this rank's key every ``interval_s``, and soon after
    a new step begins (multi-rank only; it stops when the store is gone)."""
    if not is_initialized() or world_size() == 1:
        return
    store, key = dist.distributed_c10d._get_default_store(), _HEARTBEAT_KEY.format(rank=rank())
    _quiet.clear()

    def beat() -> None:
        while not _quiet.is_set():
            _stepped.clear()  # before the step is read: a step noted from here on wakes the next write
            try:
                store.set(key, f"{time.time():.3f} {_progress['step']}")
            except Exception:  # noqa: BLE001 - the store (rank 0 or the agent) is gone: nothing left to tell
                return
            time.sleep(interval_s / 5)  # at most five writes per interval, however short the steps
            _stepped.wait(interval_s * 4 / 5)

    threading.Thread(target=beat, name="packfsdp-heartbeat", daemon=True).start()


def stop_heartbeat() -> None:
    """No more heartbeat writes from this rank (teardown, failure)."""
    _quiet.set()
    _stepped.set()


def silent_peers(stale_s: float) -> list[str]:
    """The other ranks that look unresponsive, each described (``rank 1: no heartbeat for 28 s, in step 3``,
    ``rank 2: still in step 1``): a heartbeat older than ``stale_s``, or a step behind this rank's. Best
    effort (``failure_store``: never a long wait)."""
    if not is_initialized() or world_size() == 1:
        return []
    found = []
    try:
        store = failure_store()
        now, mine = time.time(), _progress["step"]
        for r in range(world_size()):
            key = _HEARTBEAT_KEY.format(rank=r)
            if r == rank() or not store.check([key]):
                continue
            stamp, step = store.get(key).decode().split()
            quiet = now - float(stamp)
            if quiet > stale_s:
                found.append(f"rank {r}: no heartbeat for {quiet:.0f} s, in step {step}")
            elif int(step) < mine:
                found.append(f"rank {r}: still in step {step}")
    except Exception:  # noqa: BLE001 - naming the rank must never hide the failure itself
        pass
    return found
