"""``distill.teacher_logits=precompute``: the teacher's top-k per label token, computed once, stored beside the
data cache's arrays, verified like them.

The store is a folder ``teacher_topk_<fingerprint>`` in the cache folder (the fingerprint: the teacher's
weights, the compute dtype, its attention backend, the temperature and k), holding one row per label token of
every base example (the held-out ones too), in token order::

    ids.npy        int32   [rows, k]   the teacher's k most likely tokens, most likely first
    log_probs.npy  float32 [rows, k]   their log-probabilities at the temperature
    log_rest.npy   float32 [rows]      the log of the mass of every other token (-inf: none)
    checksums.json                     size and CRC-32 of each (``cache_integrity.seal_folder``)

A label token's row is its example's first row plus its rank among the example's label tokens, so any packed
row, split piece or padded batch finds its rows from ``example_ids`` and ``position_ids`` alone
(``label_rows``). ~``8 k + 4`` bytes per label token: 516 at k=64.

The pass (``precompute_top_k``) runs before training: every base example, packed whole into micro-batches
dealt to the ranks as eval deals them, through the teacher as sharded for training; each rank writes its rows
into the shared files (the cache folder must be one every rank sees, as the data cache is), rank 0 checks that
every row was written, seals the folder and renames it into place. A later run with the same teacher, data
and settings reads it; one that does not verify (a file changed, cut short or added) is computed again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from numpy.lib.format import open_memmap

from trainer import distributed
from trainer.collate import Batch
from trainer.config import ConfigError
from trainer.data.cache_integrity import intact, seal_folder
from trainer.data.examples import IGNORE_INDEX, TokenizedDataset, label_counts
from trainer.loss import sequence_of_labels
from trainer.objectives.distill.loss import TopKTeacher

log = logging.getLogger(__name__)

STORE_PREFIX = "teacher_topk_"


def top_k_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform,
    temperature: float,
    k: int,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's head on ``hidden`` ``[n, hidden]``, a chunk at a time: per row, the ``k`` most likely ids
    (int32), their log-probabilities at ``temperature`` and the log of the rest of the mass (fp32)."""
    n = hidden.shape[0]
    ids = torch.empty((n, k), dtype=torch.int32, device=hidden.device)
    values = torch.empty((n, k), dtype=torch.float32, device=hidden.device)
    rest = torch.empty(n, dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        for start in range(0, n, chunk):
            logits, _ = transform.apply(F.linear(hidden[start : start + chunk], weight, bias).float())
            log_probs = torch.log_softmax(logits / temperature, dim=-1)
            top, top_ids = log_probs.topk(k, dim=-1)
            ids[start : start + chunk], values[start : start + chunk] = top_ids.int(), top
            rest[start : start + chunk] = log_probs.scatter(1, top_ids, float("-inf")).logsumexp(-1)
    return ids, values, rest


def row_starts(base: TokenizedDataset) -> np.ndarray:
    """Each base example's first row, and the total at the end (``[examples + 1]``, int64)."""
    return np.concatenate([[0], np.cumsum(label_counts(base.loss_mask, base.offsets))]).astype(np.int64)


def label_rows(dataset: TokenizedDataset, batch: Batch, starts: np.ndarray) -> np.ndarray:
    """The store rows of ``batch``'s label tokens, in ``trainer.loss.label_positions`` order (sequence by sequence,
    token order): a label token at position ``p`` of example ``j`` is row ``starts[j]`` + the number of label
    tokens of ``j`` before ``p`` (a split piece's positions continue its example's, so the same holds)."""
    keep = batch.labels[:, 1:] != IGNORE_INDEX
    sequence = sequence_of_labels(batch.labels, batch.cu_seqlens).numpy()
    position = batch.position_ids[:, 1:][keep].numpy()
    rows = np.empty(len(position), dtype=np.int64)
    for k, example in enumerate(batch.example_ids):
        here = sequence == k
        if not here.any():
            continue
        _, mask = dataset.example(example)
        labelled = np.asarray(mask, dtype=np.int64)
        labelled[0] = 0  # an example's first token never carries a label
        before = np.cumsum(labelled) - labelled
        rows[here] = starts[dataset.base_index(example)] + before[position[here]]
    return rows


class TopKStore:
    """A verified store, memory-mapped; ``teacher`` reads a batch's rows."""

    def __init__(self, folder: Path, base: TokenizedDataset) -> None:
        self.folder = folder
        self.ids = np.load(folder / "ids.npy", mmap_mode="r")
        self.log_probs = np.load(folder / "log_probs.npy", mmap_mode="r")
        self.log_rest = np.load(folder / "log_rest.npy", mmap_mode="r")
        self.starts = row_starts(base)

    def teacher(self, dataset: TokenizedDataset, batch: Batch, device: torch.device) -> TopKTeacher:
        """The teacher's rows of ``batch`` (on the host, before it moves to ``device``)."""
        rows = label_rows(dataset, batch, self.starts)
        ids, log_probs, log_rest = (
            torch.from_numpy(np.ascontiguousarray(a[rows])).to(device)
            for a in (self.ids, self.log_probs, self.log_rest)
        )
        return TopKTeacher(ids.long(), log_probs, log_rest)


def store_problem(folder: Path, rows: int, k: int, vocab: int) -> str | None:
    """Why ``folder`` is not a complete store of ``rows`` x ``k`` ids under ``vocab`` (``None``: it is). Its
    files were checked against their checksums first (``intact``)."""
    if not intact(folder, "teacher top-k"):
        return "missing or does not verify"
    try:
        ids = np.load(folder / "ids.npy", mmap_mode="r")
        log_probs = np.load(folder / "log_probs.npy", mmap_mode="r")
        log_rest = np.load(folder / "log_rest.npy", mmap_mode="r")
    except (OSError, ValueError) as e:
        return f"an array does not read ({type(e).__name__})"
    if ids.dtype != np.int32 or log_probs.dtype != np.float32 or log_rest.dtype != np.float32:
        return "an array has the wrong type"
    if ids.shape != (rows, k) or log_probs.shape != (rows, k) or log_rest.shape != (rows,):
        return f"it holds {ids.shape} ids, the data and settings ask for {(rows, k)}"
    if rows and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        return f"an id outside the vocabulary of {vocab}"
    return None


def precompute_top_k(
    teacher_pass: Callable[[Batch], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    dataset: TokenizedDataset,
    fingerprint: str,
    k: int,
    vocab: int,
    batches: Callable[[np.ndarray], list[np.ndarray]],
    collate,
    device: torch.device,
    pad_id: int = 0,
) -> TopKStore:
    """The store of ``dataset``'s cache folder for ``fingerprint``: read when it verifies, else computed by
    ``teacher_pass`` (a batch on ``device`` -> ``top_k_rows`` of its label tokens) over this rank's micro-batches
    ``batches(lengths)`` of every base example, ``collate``-d whole, then written and sealed (see the module)."""
    base = dataclasses.replace(dataset, rows=None)  # every example of the folder: the held-out ones too
    if base.folder is None:
        raise ValueError(
            "distill.teacher_logits=precompute stores the teacher's top-k in the data cache folder; "
            "these examples have none"
        )
    folder = base.folder / f"{STORE_PREFIX}{fingerprint}"
    starts = row_starts(base)
    problem = store_problem(folder, int(starts[-1]), k, vocab) if distributed.is_rank0() else None
    problem = distributed.broadcast_object(problem)
    if problem is None:
        log.info("distill.teacher_logits=precompute: the teacher's top-%d read from %s", k, folder)
        return TopKStore(folder, base)
    log.info(
        "distill.teacher_logits=precompute: one pass of the teacher over %d examples (%d label tokens, top-%d; "
        "store %s: %s)",
        len(base),
        int(starts[-1]),
        k,
        folder.name,
        problem,
    )
    tmp = folder.with_name(f"{folder.name}.tmp{distributed.broadcast_object(os.getpid())}")
    distributed.on_rank0_then_all(lambda: _allocate(tmp, int(starts[-1]), k))
    arrays = [open_memmap(tmp / name, mode="r+") for name in ("ids.npy", "log_probs.npy", "log_rest.npy")]
    with torch.no_grad():
        for indices in batches(base.lengths):
            batch = collate(base, indices, pad_id)
            rows = label_rows(base, batch, starts)
            for array, values in zip(arrays, teacher_pass(batch.to(device)), strict=True):
                array[rows] = values.cpu().numpy()
    for array in arrays:
        array.flush()
    del arrays
    distributed.barrier()
    distributed.on_rank0_then_all(lambda: _seal(tmp, folder))
    return TopKStore(folder, base)


def _allocate(tmp: Path, rows: int, k: int) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ids = open_memmap(tmp / "ids.npy", mode="w+", dtype=np.int32, shape=(rows, k))
    ids[:] = -1  # unwritten: rank 0 finds any row no rank wrote
    ids.flush()
    open_memmap(tmp / "log_probs.npy", mode="w+", dtype=np.float32, shape=(rows, k)).flush()
    open_memmap(tmp / "log_rest.npy", mode="w+", dtype=np.float32, shape=(rows,)).flush()


def _seal(tmp: Path, folder: Path) -> None:
    ids = np.load(tmp / "ids.npy", mmap_mode="r")
    missing = int((ids[:, 0] < 0).sum()) if len(ids) else 0
    if missing:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(
            f"distill.teacher_logits=precompute: {missing} of {len(ids)} rows of {tmp} were written by "
            "no rank; every rank must see the same data cache folder (data.cache_dir on a shared file "
            "system)"
        )
    seal_folder(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
