"""Byte-identity of the data route (a tool, not a test): what a restructuring of ``trainer.data`` must not change.

    python benchmarks/data_identity.py OUT.json [--chats 20000] [--workdir DIR]
    python benchmarks/data_identity.py AFTER.json --compare BEFORE.json

Writes the sources the data tests read (generated dialogs and chats, JSON Lines with a bad row, CSV, Parquet,
a ``save_to_disk`` folder, DailyDialog text, pre-tokenized rows, a plugin registering ``jsonl``-like rows,
a mixture) and ``--chats`` generated chats (``benchmarks/data_scale.py``'s generator), then prepares each
through the cached route (``load_dataset`` into a fresh cache: arrays, stats, held-out split, epoch plan)
and the streaming route (``ExampleStream`` for ranks 0 and 1 of 2: one pass of examples, stats, the online
packer's first bins, the head's eval and probe sets), and dumps sha256 hashes of all of it to ``OUT.json``.
With ``--compare``, exits 1 naming every key that differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MAX_LENGTH = 256
HOLDOUT = (0.1, 7)


def h(*arrays) -> str:
    d = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        d.update(str(a.dtype).encode() + str(a.shape).encode())
        d.update(a.tobytes())
    return d.hexdigest()[:24]


def data_cfg(**kw):
    """A ``DataConfig`` from flat keys, whichever layout the schema has (``streaming``/``stream_*`` and
    ``mix``/``mix_by`` flat, or in nested sections)."""
    from trainer.config import DataConfig

    names = {f.name for f in dataclasses.fields(DataConfig)}
    nested: dict[str, dict] = {}
    flat = {}
    for key, value in kw.items():
        if key in names:
            flat[key] = value
        elif key.startswith("stream"):
            sub = {"streaming": "enabled", "stream_buffer": "buffer", "stream_eval_records": "eval_records"}[key]
            nested.setdefault("stream", {})[sub] = value
        elif key.startswith("mix"):
            sub = {"mix": "sources", "mix_by": "by"}[key]
            nested.setdefault("mixture", {})[sub] = value
        else:
            raise KeyError(key)
    cfg = DataConfig(**flat)
    for section, values in nested.items():
        setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **values))
    return cfg


def write_sources(root: Path, chats: int) -> dict[str, dict]:
    """The sources, as flat ``DataConfig`` keys."""
    import datasets

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from data_scale import write_chats

    from trainer.data.synthetic import generate_chats, generate_dialogs

    chat_rows = [{"messages": m} for m in generate_chats(120, 3)]
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 400}]}
    empty = {"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": ""}]}
    bad = {"messages": [{"role": "asistant", "content": "typo"}]}
    lines = (
        [json.dumps(r) for r in chat_rows[:60]]
        + ["{not json", json.dumps(long), "", json.dumps(empty), json.dumps(bad)]
        + [json.dumps(r) for r in chat_rows[60:]]
    )
    (root / "chats.jsonl").write_text("\n".join(lines) + "\n")
    folder = root / "folder"
    folder.mkdir()
    for k in range(3):
        (folder / f"part{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_rows[k * 40 : (k + 1) * 40]))
    dialogs = generate_dialogs(150, 5)
    with open(root / "qa.csv", "w", newline="") as f:
        import csv

        w = csv.writer(f)
        w.writerow(["prompt", "response"])
        for d in dialogs:
            w.writerow([d[0], " ".join(d[1:]) or "ok"])
    datasets.Dataset.from_list([{"text": " ".join(d)} for d in dialogs]).to_parquet(str(root / "docs.parquet"))
    datasets.Dataset.from_list(chat_rows).save_to_disk(str(root / "hub"))
    (root / "dialogues_text.txt").write_text("".join(" __eou__ ".join(d) + " __eou__\n" for d in dialogs))
    ids = [{"input_ids": list(range(3, 3 + n)), "labels": [-100] * 2 + list(range(5, 3 + n))} for n in range(4, 80, 3)]
    (root / "ids.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ids))
    (root / "plugin_jsonl.py").write_text(
        "import json\nfrom trainer.data import register_source\n\n"
        "@register_source('identity_plugin')\n"
        "def identity_plugin(cfg):\n"
        "    return [json.loads(line) for line in open(cfg.path) if line.strip()][::2]\n"
    )
    (root / "plugin_src.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_rows))
    write_chats(root / "big.jsonl", chats)
    return {
        "dailydialog_synthetic": {"source": "dailydialog_synthetic", "num_records": 400},
        "chat_synthetic": {"source": "chat_synthetic", "num_records": 300},
        "jsonl_bad_skip": {"source": "jsonl", "path": str(root / "chats.jsonl"), "on_bad_record": "skip"},
        "jsonl_folder_limit": {"source": "jsonl", "path": str(folder), "limit": 100},
        "jsonl_drop_responses": {"source": "jsonl", "path": str(folder), "overlong": "drop", "loss_on": "all"},
        "csv": {"source": "csv", "path": str(root / "qa.csv")},
        "parquet": {"source": "parquet", "path": str(root / "docs.parquet")},
        "hf_disk": {"source": "hf", "path": str(root / "hub")},
        "dailydialog_text": {"source": "dailydialog", "path": str(root / "dialogues_text.txt")},
        "pretokenized": {"source": "jsonl", "path": str(root / "ids.jsonl")},
        "plugin": {
            "source": "identity_plugin",
            "path": str(root / "plugin_src.jsonl"),
            "plugins": [str(root / "plugin_jsonl.py")],
        },
        "mixture": {
            "mix": [
                {"source": "chat_synthetic", "num_records": 200, "weight": 2.0},
                {"source": "jsonl", "path": str(folder), "weight": 1.0},
            ],
            "mix_by": "examples",
        },
        f"chats_{chats}": {"source": "jsonl", "path": str(root / "big.jsonl"), "num_proc": 2},
    }


def stats_dict(stats) -> dict:
    return dataclasses.asdict(stats)


def cached(cfg, tokenizer) -> dict:
    from trainer.config import PackingConfig
    from trainer.data import load_dataset
    from trainer.data.holdout import split_holdout
    from trainer.packing import build_sampler

    ds = load_dataset(cfg, tokenizer, MAX_LENGTH)
    train, held = split_holdout(ds, HOLDOUT[0], HOLDOUT[1], None)
    out = {
        "arrays": h(ds.tokens, ds.loss_mask, ds.offsets)
        if hasattr(ds, "tokens")
        else h(*[a for i in range(len(ds)) for a in ds.example(i)]),
        "lengths": h(ds.lengths),
        "labels": h(ds.label_counts()),
        "stats": stats_dict(ds.stats),
        "examples": len(ds),
        "train_rows": h(getattr(train, "rows", None) if getattr(train, "rows", None) is not None else train.lengths),
        "held_rows": (h(held.rows) if getattr(held, "rows", None) is not None else h(held.lengths)) if held else None,
    }
    for world in (1, 2):
        sampler = build_sampler(
            train.lengths, PackingConfig(balance="tokens", token_budget=1024), world - 1, world, 1234
        )
        plan = sampler.plan(0)
        out[f"plan_w{world}"] = h(plan.order, *[b for r in plan.rounds for b in r])
    return out


def streamed(cfg, tokenizer) -> dict:
    from trainer.config import PackingConfig

    try:
        from trainer.data.stream import ExampleStream, head_sets
    except ImportError:
        from trainer.data.streaming import ExampleStream, head_sets
    from trainer.packing.online import StreamingSampler

    out = {}
    for rank in (0, 1):
        stream = ExampleStream(cfg, tokenizer, MAX_LENGTH, rank, 2, HOLDOUT)
        examples, held = [], []
        while rows := stream.next_rows(256):  # one pass over this rank's share
            more, more_held = stream.examples(rows)
            examples, held = examples + more, held + more_held
        out[f"rank{rank}"] = {
            "examples": len(examples),
            "arrays": h(*[a for e in examples for a in e]),
            "held": h(*[a for e in held for a in e]),
            "stats": stats_dict(stream.stats),
            "held_out": stream.held_out,
        }
        sampler = StreamingSampler(
            ExampleStream(cfg, tokenizer, MAX_LENGTH, rank, 2, HOLDOUT),
            PackingConfig(balance="tokens", token_budget=1024),
            64,
            rank,
            2,
        )
        out[f"rank{rank}"]["bins"] = h(*[np.asarray(sampler.next_microbatch()[1]) for _ in range(12)])
    eval_set, probe = head_sets(cfg, tokenizer, MAX_LENGTH, HOLDOUT, None)
    out["head_eval"] = h(eval_set.tokens, eval_set.loss_mask, eval_set.offsets) if eval_set is not None else None
    out["head_probe"] = h(probe.tokens, probe.loss_mask, probe.offsets)
    return out


def outcome(route, cfg, tokenizer) -> dict:
    """What ``route`` gives, or the error it raises (an error is behaviour too)."""
    try:
        return route(cfg, tokenizer)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def run(chats: int, workdir: Path | None) -> dict:
    from trainer.config import ModelConfig
    from trainer.data import load_tokenizer

    root = Path(workdir or tempfile.mkdtemp(prefix="packfsdp_identity_"))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        sources = write_sources(root, chats)
        cache = str(root / "cache")
        tokenizer = load_tokenizer(
            ModelConfig(chat_template="chatml", tokenizer_vocab_size=512),
            data_cfg(source="chat_synthetic", num_records=200, cache_dir=cache),
        )
        result = {}
        for name, keys in sources.items():
            cfg = data_cfg(cache_dir=cache, **keys)
            result[name] = {"cached": outcome(cached, cfg, tokenizer)}
            if not keys.get("mix"):
                stream_cfg = data_cfg(cache_dir=cache, stream_eval_records=200, **keys)
                result[name]["streamed"] = outcome(streamed, stream_cfg, tokenizer)
            print(name, json.dumps(result[name]["cached"].get("stats", result[name]["cached"])), flush=True)
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def differences(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in differences(a.get(k), b.get(k), f"{path}/{k}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--chats", type=int, default=20000)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--compare", type=Path, help="a JSON written before: exit 1 naming every difference")
    args = parser.parse_args()
    result = {"chats": args.chats, "sources": run(args.chats, args.workdir)}
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    if args.compare:
        diff = differences(json.loads(args.compare.read_text()), result)
        print("\n".join(diff) if diff else f"identical to {args.compare}: {len(result['sources'])} sources")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
