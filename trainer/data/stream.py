"""The stream sink (``data.stream.enabled=true``): records read, rendered and tokenized on the fly, never cached,
then packed online (``trainer.packing.online``).

A source is read as the one dispatcher's parts (``trainer.data.parts.source_parts(streaming=True)``), in
order, each a ``datasets.IterableDataset`` (or a list of records):

- ``jsonl`` / ``parquet`` / ``csv``: one part per file (``load_dataset(builder, data_files=file,
  streaming=True)``). Every rank reads the file and keeps rows ``rank, rank + world, ...``, so a bad row
  is named ``file:line`` (``file row i`` for Parquet);
- ``hf``: the hub dataset streamed (a local dataset folder as ``to_iterable_dataset``), split by
  ``datasets.distributed.split_dataset_by_node`` (whole shards per rank when they divide evenly, else every
  world-th row): no rank downloads another's shards; rows are named by the rank's shard;
- a plugin may return an ``IterableDataset`` (split the same way) or a ``Dataset``; every other source,
  the synthetic ones included, returns its records, dealt round-robin like a file's rows.

Records are rendered, masked and truncated by ``trainer.data.render.render_outcomes`` (the rules of the
cached path), ``STREAM_CHUNK`` rows at a time; bad rows follow ``data.on_bad_record`` and every count goes
to this rank's ``DatasetStats``. The held-out split is the cached path's hash
(``trainer.data.holdout.holdout_mask``): a held-out example is left out of training wherever it appears, and
the eval set is the held-out examples among the stream's first ``data.stream.eval_records`` records (rank
0 reads them once and shares them). A stream cannot be shuffled exactly on resume, so it is read in order.

A rank's share never ends: when it runs out, the next pass starts from its beginning (``passes``), so a
streaming run's length is ``max_steps``. A pass that yields no training example is an error.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import asdict

import numpy as np
from datasets.distributed import split_dataset_by_node
from transformers import PreTrainedTokenizerBase

from trainer import distributed
from trainer.config import DataConfig
from trainer.data.bad_records import BadRecordError, BadRecords
from trainer.data.examples import (
    DatasetStats,
    Example,
    TokenizedDataset,
    count_kept,
    from_examples,
    log_dataset_stats,
)
from trainer.data.holdout import holdout_mask
from trainer.data.parts import Part, Places, is_table, source_parts
from trainer.data.render import Outcome, render_outcomes, stats_of
from trainer.data.tables import Row, rows_to_records

log = logging.getLogger(__name__)

STREAM_CHUNK = 256
"""Rows rendered at a time (one batched tokenizer call)."""
PROBE_EXAMPLES = 256
"""Training examples of the stream's head kept for the start-up self-check."""


class RowStream:
    """This rank's rows of one part, resumable: ``state_dict`` holds the rows read and, for a ``datasets``
    stream, its own position (``IterableDataset.state_dict``), so a resume skips whole shards unread."""

    def __init__(self, part: Part, rank: int, world_size: int, state: dict | None = None) -> None:
        source = part.open()
        source = [] if source is None else source
        self.index = int(state["index"]) if state else 0
        """Rows of the part (of the rank's shard when split by node) read so far."""
        self.table = is_table(source)
        self.dataset = None
        split = part.split_by_node and self.table
        if not self.table:  # records in memory: jump straight to the position
            self._rows = itertools.islice(iter(source), self.index, None)
        else:
            self.dataset = split_dataset_by_node(source, rank, world_size) if split else source
            if state and state.get("datasets"):
                self.dataset.load_state_dict(state["datasets"])
            self._rows = iter(self.dataset)
        self.places = Places(f"{part.name} (shard of rank {rank})", "") if split else part.places
        self.keep = (lambda i: True) if split else (lambda i: i % world_size == rank)
        self.name = part.name

    def read(self, n: int, bad: BadRecords) -> list:
        """Up to ``n`` of this rank's rows (fewer only at the part's end). A part ``datasets`` cannot read
        further is an error naming it, or, under ``data.on_bad_record=skip``, ends here (counted, logged)."""
        rows = []
        while len(rows) < n:
            try:
                value = next(self._rows)
            except StopIteration:
                break
            except Exception as e:  # noqa: BLE001 - any parse failure of the stream: named, never a trace
                self._rows = iter(())
                bad.bad(
                    self.name,
                    f"not readable as a stream after row {self.index} ({str(e).splitlines()[0][:200]})",
                    "file",
                )
                break
            i, self.index = self.index, self.index + 1
            if self.keep(i):
                rows.append(_placed(value, self.places.lazy(i)))
        return rows

    def state_dict(self) -> dict:
        return {"index": self.index, "datasets": self.dataset.state_dict() if self.dataset is not None else None}


def _placed(value: object, where: str) -> object:
    if not isinstance(value, dict) or getattr(value, "where", ""):
        return value  # the renderer reports a non-dict as a bad record; a record read by lines keeps its place
    row = Row(value)
    row.where = where
    return row


class ExampleStream:
    """This rank's training examples of a source, rendered on the fly, pass after pass (see the module
    docstring). ``next_chunk`` gives the next examples; ``state_dict`` says where the stream stands."""

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        max_length: int,
        rank: int = 0,
        world_size: int = 1,
        holdout: tuple[float, int] = (0.0, 0),
        label: str = "stream",
    ) -> None:
        self.cfg, self.tokenizer, self.max_length = cfg, tokenizer, max_length
        self.rank, self.world_size, self.holdout, self.label = rank, world_size, holdout, label
        self.bad = BadRecords(cfg.on_bad_record, cfg.source)
        self.parts = source_parts(cfg, self.bad, streaming=True)
        self.stats = DatasetStats()
        """This rank's counts so far: ``examples`` are training examples (held-out ones are in ``held_out``)."""
        self.held_out = 0
        self.part, self.passes, self.pass_examples = 0, 0, 0
        self.rows: RowStream | None = None
        self._rows_state: dict | None = None

    def next_chunk(self) -> list[Example]:
        """The next training examples (at least one; a new pass starts when this rank's share ends)."""
        while True:
            rows = self.next_rows(STREAM_CHUNK)
            if rows and (examples := self.examples(rows)[0]):
                return examples

    def next_rows(self, n: int) -> list:
        """Up to ``n`` rows of the current part; ``[]`` when the pass ended (the next call starts another)."""
        while self.part < len(self.parts):
            if self.rows is None:
                self.rows = RowStream(self.parts[self.part], self.rank, self.world_size, self._rows_state)
                self._rows_state = None
            if rows := self.rows.read(n, self.bad):
                return rows
            self.part, self.rows = self.part + 1, None
        self._end_pass()
        return []

    def _end_pass(self) -> None:
        if self.pass_examples == 0:
            s = self.stats
            raise BadRecordError(
                f"data.source={self.cfg.source}: rank {self.rank}'s share of the stream holds no training example "
                f"({s.records} records read; left out: {s.left_out()}; {self.held_out} held out for eval)"
            )
        self.part, self.passes, self.pass_examples = 0, self.passes + 1, 0
        log_dataset_stats(f"{self.cfg.source} ({self.label} of rank {self.rank}, after pass {self.passes})", self.stats)

    def examples(self, rows: list) -> tuple[list[Example], list[Example]]:
        """``rows`` of the current part rendered: (training examples, held-out examples); counts updated."""
        records = rows_to_records(rows, self.cfg, self.bad) if self.rows.table else rows
        rendered = render_outcomes(records, self.tokenizer, self.cfg, self.max_length, self.bad)
        counts = stats_of(np.array([outcome for _, _, outcome, _ in rendered], dtype=np.int8))
        kept = [
            (np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool))
            for ids, mask, outcome, _ in rendered
            if outcome <= Outcome.TRUNCATED
        ]
        held = self.held_out_mask(kept)
        train = [e for e, h in zip(kept, held, strict=True) if not h]
        counts = count_kept(counts, train)
        counts.records = len(rows)
        self.stats.add(counts)
        self.stats.dropped_bad = self.bad.skipped  # every bad row, whichever step noticed it
        self.held_out += len(kept) - len(train)
        self.pass_examples += len(train)
        return train, [e for e, h in zip(kept, held, strict=True) if h]

    def held_out_mask(self, examples: list[Example]) -> np.ndarray:
        """The cached path's held-out rule, per example (``trainer.data.holdout``)."""
        fraction, seed = self.holdout
        if not examples or fraction <= 0:
            return np.zeros(len(examples), dtype=bool)
        return holdout_mask(from_examples(examples), fraction, seed)

    # ------------------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        return {
            "part": self.part,
            "passes": self.passes,
            "pass_examples": self.pass_examples,
            "rows": self.rows.state_dict() if self.rows is not None else self._rows_state,
            "stats": asdict(self.stats),
            "held_out": self.held_out,
            "bad_skipped": self.bad.skipped,
        }

    def load_state_dict(self, state: dict) -> None:
        self.part, self.passes = int(state["part"]), int(state["passes"])
        self.pass_examples = int(state["pass_examples"])
        self.rows, self._rows_state = None, state["rows"]  # reopened at the saved position on the next read
        self.stats, self.held_out = DatasetStats(**state["stats"]), int(state["held_out"])
        self.bad.skipped = int(state["bad_skipped"])


def head_sets(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    holdout: tuple[float, int],
    max_eval: int | None,
) -> tuple[TokenizedDataset | None, TokenizedDataset]:
    """(eval set, self-check examples) from the stream's first ``data.stream.eval_records`` records, read once
    on rank 0 and shared: the held-out ones (at most ``max_eval``; ``None`` when there is none) and the first
    ``PROBE_EXAMPLES`` training ones."""
    found: dict = {}

    def scan() -> None:
        stream = ExampleStream(cfg, tokenizer, max_length, holdout=holdout, label="eval scan")
        train, held, read, wanted = [], [], 0, cfg.stream.eval_records
        while read < wanted and (rows := stream.next_rows(min(STREAM_CHUNK, wanted - read))):
            read += len(rows)
            more_train, more_held = stream.examples(rows)
            train += more_train[: PROBE_EXAMPLES - len(train)]
            held += more_held
        held = held[:max_eval] if max_eval is not None else held
        if holdout[0] > 0 and not held:
            log.warning(
                "no held-out example among the stream's first %d records: eval is off "
                "(raise data.stream.eval_records or eval.holdout_fraction)",
                read,
            )
        found["sets"] = (from_examples(held) if held else None, from_examples(train or held))

    distributed.on_rank0_then_all(scan)
    return distributed.broadcast_object(found.get("sets"))


__all__ = ["ExampleStream", "RowStream", "head_sets"]
