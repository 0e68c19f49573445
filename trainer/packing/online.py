"""Online packing for streamed data (``data.stream.enabled=true``): best fit inside a bounded window of examples.

Global best-fit decreasing (``trainer.packing.strategies``) sees every length before it opens a bin; a
stream shows examples one at a time and may never end. ``OnlineBestFit`` keeps a window of up to
``data.stream.buffer`` waiting examples (ids and lengths only) and builds one bin at a time from them:

1. the bin opens with the longest waiting example, or with the oldest one once it has waited ``window``
   bins (so no example waits forever, whatever the lengths that follow it);
2. then, repeatedly, the longest waiting example that fits the room left (ties: the oldest first) joins,
   until none fits or the bin holds ``packing.max_examples_per_bin``.

A bin is built only when the window is full, so each choice is made among ``window`` examples; with a
window as large as the data this is best fit decreasing seen bin by bin. ``benchmarks/stream_fill.py``
measures the fill against global BFD (``docs/data.md``).

``StreamingSampler`` gives the trainer this rank's bins with ``MicroBatchSampler``'s interface. Its stream
(``trainer.data.stream.ExampleStream``) never ends: a rank's share is read again from its start when it
runs out, so every rank serves any number of micro-batches and takes the same ``max_steps`` steps by
construction, without communication. **Resume** is exact: the stream's position and every waiting
example (tokens and masks) are saved per rank (``save_rank_state``) and restored before the next bin.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from trainer.data.examples import Example

if TYPE_CHECKING:
    from trainer.config import PackingConfig
    from trainer.data.examples import DatasetStats

log = logging.getLogger(__name__)


class OnlineBestFit:
    """Bins of example ids from a window of at most ``window`` waiting examples (see the module docstring)."""

    def __init__(self, budget: int, window: int, cap: int | None = None) -> None:
        self.budget, self.window, self.cap = budget, window, cap
        self.waiting: dict[int, tuple[int, int]] = {}
        """Example id -> (length, bins made when it arrived), in arrival order."""
        self._by_length: list[tuple[int, int]] = []
        """``(length, -id)`` of every waiting example, sorted: the longest (then oldest) that fits is a bisect."""
        self.bins_made = 0

    def __len__(self) -> int:
        return len(self.waiting)

    @property
    def full(self) -> bool:
        return len(self.waiting) >= self.window

    def add(self, example_id: int, length: int) -> None:
        if not 0 < length <= self.budget:
            raise ValueError(f"example {example_id} has {length} tokens; a bin holds 1 to {self.budget}")
        self.waiting[example_id] = (length, self.bins_made)
        bisect.insort(self._by_length, (length, -example_id))

    def next_bin(self) -> list[int]:
        """The ids of the next bin (empty when nothing waits)."""
        if not self.waiting:
            return []
        oldest = next(iter(self.waiting))
        overdue = self.bins_made - self.waiting[oldest][1] >= self.window
        chosen = [oldest if overdue else -self._by_length[-1][1]]
        room = self.budget - self._take(chosen[0])
        while room > 0 and (self.cap is None or len(chosen) < self.cap):
            fits = bisect.bisect_right(self._by_length, (room, 1))  # every key (length <= room, -id <= 0)
            if fits == 0:
                break
            chosen.append(-self._by_length[fits - 1][1])
            room -= self._take(chosen[-1])
        self.bins_made += 1
        return chosen

    def _take(self, example_id: int) -> int:
        length, _ = self.waiting.pop(example_id)
        del self._by_length[bisect.bisect_left(self._by_length, (length, -example_id))]
        return length

    def state_dict(self) -> dict:
        return {"bins_made": self.bins_made, "waiting": [[i, n, t] for i, (n, t) in self.waiting.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.bins_made = int(state["bins_made"])
        self.waiting = {int(i): (int(n), int(t)) for i, n, t in state["waiting"]}
        self._by_length = sorted((n, -i) for i, (n, _) in self.waiting.items())


class ExampleSource(Protocol):
    """What ``StreamingSampler`` reads: ``trainer.data.stream.ExampleStream``."""

    passes: int
    stats: DatasetStats

    def next_chunk(self) -> list[Example]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class StreamingSampler:
    """This rank's micro-batches from an endless example stream, packed online (``MicroBatchSampler``'s
    interface: ``next_microbatch``, ``epoch``, ``state_dict``; plus the per-rank state of the checkpoint).

    Example ids are ``k * world_size + rank`` for this rank's k-th example, so they are unique over ranks.
    """

    def __init__(
        self, stream: ExampleSource, cfg: PackingConfig, window: int, rank: int, world_size: int, fingerprint: str = ""
    ) -> None:
        self.stream, self.cfg = stream, cfg
        self.rank, self.world_size = rank, world_size
        self.packer = OnlineBestFit(cfg.token_budget, window, cfg.max_examples_per_bin)
        self.waiting: dict[int, Example] = {}
        self.served: dict[int, Example] = {}
        """The examples of the bin served last (the trainer collates them right away)."""
        self.examples_read = 0
        self.data_fingerprint = fingerprint

    @property
    def epoch(self) -> int:
        """Completed passes over this rank's share of the stream."""
        return self.stream.passes

    def fill(self) -> None:
        """Read examples until the window is full (it may then hold up to one chunk more than ``window``:
        the stream renders rows a chunk at a time)."""
        passes = self.stream.passes
        while not self.packer.full:
            if self.stream.passes > passes and not self.packer.bins_made:
                passes = self.stream.passes  # warned once per pass, only while the first window fills
                log.warning(
                    "data.stream.buffer=%d is more than rank %d's share of the stream (%d examples): the "
                    "window holds repeats of the same examples; lower data.stream.buffer",
                    self.packer.window,
                    self.rank,
                    self.examples_read // max(passes, 1),
                )
            for example in self.stream.next_chunk():
                example_id = self.examples_read * self.world_size + self.rank
                self.waiting[example_id] = example
                self.packer.add(example_id, len(example[0]))
                self.examples_read += 1

    def next_microbatch(self) -> tuple[int, np.ndarray, bool]:
        """(pass, bin of example ids, False): a stream has no last micro-batch."""
        self.fill()
        ids = self.packer.next_bin()
        self.served = {i: self.waiting.pop(i) for i in ids}
        return self.epoch, np.asarray(ids, dtype=np.int64), False

    # ------------------------------------------------------------------------------------------- resume
    def fingerprint(self) -> str:
        """What the bins depend on besides the stream's position: the packing config, the window, the data."""
        parts = [asdict(self.cfg), self.packer.window, self.data_fingerprint]
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def state_dict(self) -> dict:
        """The run-wide part (rank 0 saves it); each rank's position is in ``save_rank_state``."""
        return {"streaming": True, "world_size": self.world_size, "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        if not state.get("streaming"):
            raise ValueError(
                "the checkpoint was saved without data.stream.enabled; resume it with data.stream.enabled=false"
            )
        if int(state["world_size"]) != self.world_size:
            raise ValueError(
                f"a streaming run resumes on the world size it was saved on ({state['world_size']} rank(s), "
                f"now {self.world_size}): each rank's stream position and buffer belong to its shard"
            )
        if state["fingerprint"] != self.fingerprint():
            raise ValueError("saved with a different packing config, data.stream.buffer or data source")

    def save_rank_state(self, path: Path) -> None:
        """This rank's stream position, waiting examples and packer, as one safetensors file (no pickle)."""
        ids = list(self.waiting)
        lengths = np.array([len(self.waiting[i][0]) for i in ids], dtype=np.int64)
        tensors = {
            "tokens": np.concatenate([self.waiting[i][0] for i in ids] or [np.zeros(0, np.int32)]).astype(np.int32),
            "loss_mask": np.concatenate([self.waiting[i][1] for i in ids] or [np.zeros(0, bool)]).astype(np.uint8),
            "ids": np.array(ids, dtype=np.int64),
            "lengths": lengths,
        }
        meta = {"stream": self.stream.state_dict(), "packer": self.packer.state_dict(), "read": self.examples_read}
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"state": json.dumps(meta)})

    def load_rank_state(self, path: Path) -> None:
        if not path.is_file():
            raise ValueError(f"{path.name} is missing: the checkpoint holds no stream state for rank {self.rank}")
        with safe_open(str(path), framework="numpy") as f:
            meta = json.loads(f.metadata()["state"])
            t = {k: f.get_tensor(k) for k in f.keys()}
        bounds = np.concatenate([[0], np.cumsum(t["lengths"])])
        self.waiting = {
            int(i): (t["tokens"][lo:hi].copy(), t["loss_mask"][lo:hi].astype(bool))
            for i, lo, hi in zip(t["ids"], bounds[:-1], bounds[1:], strict=True)
        }
        self.stream.load_state_dict(meta["stream"])
        self.packer.load_state_dict(meta["packer"])
        self.examples_read, self.served = int(meta["read"]), {}


class ServedExamples:
    """The trainer's ``dataset`` when streaming: the examples of the bin just served, by id (what
    ``collate_packed`` reads), and this rank's counts of what its stream read so far."""

    def __init__(self, sampler: StreamingSampler) -> None:
        self.sampler = sampler

    def example(self, i: int) -> Example:
        return self.sampler.served[int(i)]

    @property
    def stats(self) -> DatasetStats:
        return self.sampler.stream.stats

    def __len__(self) -> int:
        """Training examples this rank has read so far."""
        return self.sampler.examples_read

    def check_unchanged(self) -> None:
        """A stream is read from its source, never from a memory-mapped cache: nothing can change under it."""


__all__ = ["OnlineBestFit", "ServedExamples", "StreamingSampler"]
