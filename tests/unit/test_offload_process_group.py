"""The process-group backend: ``cuda:nccl,cpu:gloo`` when FSDP offloads to the CPU on CUDA.

With ``parallel.cpu_offload=true`` the gradients live on the host, and ``clip_grad_norm_`` all-reduces their
norms there; an NCCL-only group fails on them ("No backend type associated with device type cpu"). The
backend string is checked through a stand-in ``init_process_group`` (no GPU here); the failure itself is
reproduced on 2 CPU ranks, with ``cuda:gloo`` standing in for an NCCL-only group.
"""

from __future__ import annotations

import datetime
import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer import distributed
from trainer.config import JobConfig, ParallelConfig

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


class GroupStarted(Exception):
    """Raised by the stand-in ``init_process_group`` once it has seen its arguments."""


@pytest.fixture
def started_groups(monkeypatch):
    """The keyword arguments of every ``init_process_group`` call (the call stops the caller there)."""
    calls = []

    def init_process_group(**kwargs):
        calls.append(kwargs)
        raise GroupStarted

    monkeypatch.setattr(distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", init_process_group)
    monkeypatch.setenv("RANK", "0")  # as under torchrun: init_distributed leaves the environment alone
    return calls


@pytest.mark.parametrize(
    ("device", "backend", "cpu_offload", "expected"),
    [
        ("cuda", "auto", False, "nccl"),
        ("cuda", "auto", True, "cuda:nccl,cpu:gloo"),
        ("cuda", "nccl", True, "cuda:nccl,cpu:gloo"),
        ("cuda", "gloo", True, "gloo"),  # gloo serves CPU tensors already
        ("cpu", "auto", False, "gloo"),
        ("cpu", "auto", True, "gloo"),
    ],
)
def test_backend_string(started_groups, device, backend, cpu_offload, expected):
    device = CUDA if device == "cuda" else CPU
    with pytest.raises(GroupStarted):
        distributed.init_distributed(device, backend, cpu_offload=cpu_offload)
    assert started_groups[0]["backend"] == expected
    assert started_groups[0]["device_id"] == (device if device.type == "cuda" else None)


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_trainer_passes_cpu_offload_to_the_group(started_groups, monkeypatch, cpu_offload):
    from trainer.loop import Trainer  # here: the 2-rank test's spawned workers import this module

    monkeypatch.setattr(distributed, "resolve_device", lambda device: CUDA)
    cfg = JobConfig(parallel=ParallelConfig(device="cuda", cpu_offload=cpu_offload))
    with pytest.raises(GroupStarted):
        Trainer.start_distributed(SimpleNamespace(cfg=cfg))
    assert started_groups[0]["backend"] == ("cuda:nccl,cpu:gloo" if cpu_offload else "nccl")


def on_this_machine(backend: str) -> str:
    """A CPU machine's stand-in for a CUDA backend string: NCCL (CUDA tensors only) becomes ``cuda:gloo``."""
    return ",".join(part.replace("nccl", "gloo") if ":" in part else "cuda:gloo" for part in backend.split(","))


def clip_offloaded_grads(rank: int, backends: list[str], store_dir: str) -> None:
    """On each backend in turn: FSDP2 with CPU offload, one backward, ``clip_grad_norm_``; rank 0 writes how
    each went to ``store_dir/outcomes.json``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    # Forked: the parent's OpenMP pool is unusable here (the first parallel op would wait forever on
    # libgomp's team barrier); one thread does not use it.
    torch.set_num_threads(1)
    outcomes = {}
    for i, backend in enumerate(backends):
        dist.init_process_group(
            backend,
            init_method=f"file://{store_dir}/store{i}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
            fully_shard(model, mesh=init_device_mesh("cpu", (2,)), offload_policy=CPUOffloadPolicy(pin_memory=False))
            model(torch.randn(3, 4)).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            outcomes[backend] = "ok"
        except RuntimeError as e:
            outcomes[backend] = str(e)
        finally:
            dist.destroy_process_group()
    if rank == 0:
        with open(f"{store_dir}/outcomes.json", "w") as f:
            json.dump(outcomes, f)


@pytest.mark.slow
def test_clip_grad_norm_on_offloaded_grads_needs_a_cpu_backend(tmp_path):
    nccl_only = on_this_machine(distributed.process_group_backend(CUDA, "auto", cpu_offload=False))
    offloading = on_this_machine(distributed.process_group_backend(CUDA, "auto", cpu_offload=True))
    assert (nccl_only, offloading) == ("cuda:gloo", "cuda:gloo,cpu:gloo")
    # fork: the children reuse this process's imports (spawn re-imports torch and this module in each).
    mp.start_processes(
        clip_offloaded_grads, args=([nccl_only, offloading], str(tmp_path)), nprocs=2, start_method="fork"
    )
    outcomes = json.loads((tmp_path / "outcomes.json").read_text())
    assert "No backend type associated with device type cpu" in outcomes[nccl_only]
    assert outcomes[offloading] == "ok"
