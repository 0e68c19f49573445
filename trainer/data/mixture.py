"""Mixtures: several sources in one training set, each with a weight (``data.mixture.sources``, ``.by``).

Each item of ``data.mixture.sources`` is one source's data settings (``source``, ``path``, ``columns``, ...;
the rest comes from ``data``) plus its ``weight``. Every source is tokenized and cached on its own; the
mixture is as large as all of them together (in examples, or in tokens with ``data.mixture.by=tokens``) and
gives source ``i`` the share ``weight_i / sum(weights)`` of it: a source below its share is repeated (whole
passes, then a seeded random part of one more), a source above it contributes a seeded random subset. The mixture is a
pure function of (the sources, the weights, ``data.seed``).

Held-out examples stay hash-based (``trainer.evaluate``): an example's side depends on its tokens only, so
a repeated example never straddles the split, and each source's held-out share is its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import numpy as np

from trainer.config import ConfigError, DataConfig, MixtureConfig, retired_key
from trainer.data.examples import DatasetStats, TokenizedDataset


def mix_components(cfg: DataConfig) -> list[tuple[DataConfig, float]]:
    """Each mixed source's full data config and its weight (one, weight 1, without ``data.mixture.sources``)."""
    if not cfg.mixture.sources:
        return [(cfg, 1.0)]
    names = {f.name for f in fields(DataConfig)} - {"mixture", "stream"}
    components = []
    for k, item in enumerate(cfg.mixture.sources):
        item = dict(item)
        weight = float(item.pop("weight", 1.0))
        unknown = sorted(set(item) - names)
        if retired := next((r for name in unknown if (r := retired_key(f"data.{name}"))), None):
            raise ConfigError(f"data.mixture.sources[{k}]: {retired}")
        if unknown or weight <= 0:
            raise ConfigError(
                f"data.mixture.sources[{k}]: "
                + (f"unknown field(s) {', '.join(unknown)}" if unknown else f"weight must be > 0, got {weight}")
            )
        components.append((replace(cfg, mixture=MixtureConfig(), **item), weight))
    return components


def component_name(cfg: DataConfig) -> str:
    return f"{cfg.source}" + (f":{cfg.path}" if cfg.path else "")


@dataclass
class MixtureDataset:
    """Examples drawn from several tokenized datasets: example ``i`` is ``parts[part[i]]``'s ``row[i]``."""

    parts: list[TokenizedDataset]
    part: np.ndarray
    row: np.ndarray
    stats: DatasetStats
    names: list[str]

    def __len__(self) -> int:
        return len(self.row)

    def _gather(self, per_part: Callable[[TokenizedDataset], np.ndarray], dtype=np.int64) -> np.ndarray:
        out = np.zeros(len(self), dtype=dtype)
        for p, ds in enumerate(self.parts):
            mine = self.part == p
            out[mine] = per_part(ds)[self.row[mine]]
        return out

    @property
    def lengths(self) -> np.ndarray:
        return self._gather(lambda ds: ds.lengths)

    def label_counts(self) -> np.ndarray:
        return self._gather(lambda ds: ds.label_counts())

    def content_hashes(self, seed: int) -> np.ndarray:
        return self._gather(lambda ds: ds.content_hashes(seed), np.uint64)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.parts[self.part[i]].example(int(self.row[i]))

    def check_unchanged(self) -> None:
        """``TokenizedDataset.check_unchanged`` of every source."""
        for ds in self.parts:
            ds.check_unchanged()

    def label_token_counts(self) -> np.ndarray:
        """``TokenizedDataset.label_token_counts`` over the mixture's draws."""
        per_part = [ds.select(self.row[self.part == p]).label_token_counts() for p, ds in enumerate(self.parts)]
        counts = np.zeros(max(map(len, per_part), default=0), np.int64)
        for c in per_part:
            counts[: len(c)] += c
        return counts

    def select(self, indices: np.ndarray) -> MixtureDataset:
        indices = np.asarray(indices, dtype=np.int64)
        return MixtureDataset(self.parts, self.part[indices], self.row[indices], self.stats, self.names)

    def shares(self) -> list[dict]:
        """Per source: examples and tokens in the mixture and their shares (for ``trainer.analyze``)."""
        lengths, total = self.lengths, max(int(self.lengths.sum()), 1)
        return [
            {
                "source": name,
                "examples": int((self.part == p).sum()),
                "tokens": int(lengths[self.part == p].sum()),
                "example_share": float((self.part == p).mean()),
                "token_share": int(lengths[self.part == p].sum()) / total,
                "unique_examples": len(self.parts[p]),
            }
            for p, name in enumerate(self.names)
        ]


def mix(datasets: list[TokenizedDataset], weights: list[float], by: str, seed: int, names: list[str]) -> MixtureDataset:
    """The mixture of ``datasets`` with shares ``weights`` of all their examples (``by=examples``) or tokens."""
    shares = np.asarray(weights, dtype=np.float64) / sum(weights)
    sizes = [int(ds.lengths.sum()) if by == "tokens" else len(ds) for ds in datasets]
    parts, rows = [], []
    for p, (ds, share) in enumerate(zip(datasets, shares, strict=True)):
        quota = share * sum(sizes)
        passes = int(np.ceil(quota / max(sizes[p], 1))) + 1
        rng = np.random.default_rng([seed, p])
        order = np.concatenate([rng.permutation(len(ds)) for _ in range(passes)])
        if by == "tokens":
            take = int(np.searchsorted(np.cumsum(ds.lengths[order]), quota)) + 1
        else:
            take = int(round(quota))
        rows.append(np.sort(order[: max(1, min(take, len(order)))]))
        parts.append(np.full(len(rows[-1]), p, dtype=np.int32))
    stats = DatasetStats()
    for ds in datasets:
        stats.add(ds.stats)
    return MixtureDataset(datasets, np.concatenate(parts), np.concatenate(rows), stats, names)
