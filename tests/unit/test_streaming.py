"""Streaming (``data.stream.enabled=true``): online packing, equal steps per rank, exact resume, bad rows, refusals."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import numpy as np
import pytest

from trainer.config import ConfigError, DataConfig, JobConfig, MixtureConfig, PackingConfig, StreamConfig
from trainer.data import stream as streaming
from trainer.data.bad_records import BadRecordError
from trainer.data.holdout import holdout_mask
from trainer.data.stream import ExampleStream, head_sets
from trainer.packing.online import OnlineBestFit, StreamingSampler

ON = StreamConfig(enabled=True)


def drain(packer: OnlineBestFit, lengths: list[int]) -> list[list[int]]:
    bins = []
    for i, n in enumerate(lengths):
        packer.add(i, n)
        if packer.full:
            bins.append(packer.next_bin())
    while len(packer):
        bins.append(packer.next_bin())
    return bins


def test_online_best_fit_is_deterministic_within_budget_and_loses_nothing():
    lengths = np.random.default_rng(0).integers(1, 300, size=2000).tolist()
    bins = drain(OnlineBestFit(512, 64), lengths)
    assert bins == drain(OnlineBestFit(512, 64), lengths)
    assert all(sum(lengths[i] for i in b) <= 512 for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    fill = sum(lengths) / (len(bins) * 512)
    assert fill > 0.97, fill
    capped = drain(OnlineBestFit(512, 64, cap=2), lengths)
    assert max(len(b) for b in capped) == 2


def test_online_best_fit_never_lets_an_example_wait_forever():
    """A long stream of examples that pair up exactly would starve a lone odd one; the oldest opens a bin
    once it has waited ``window`` bins."""
    lengths = [100] + [256] * 400
    packer, served_at = OnlineBestFit(512, 8), {}
    for i, n in enumerate(lengths):
        packer.add(i, n)
        if packer.full:
            for j in packer.next_bin():
                served_at[j] = packer.bins_made
    assert served_at[0] <= 8 + 1


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def stream_cfg(tmp_path, rows: int = 7, **extra) -> DataConfig:
    rows = [{"text": " ".join(["word"] * (3 + (7 * k) % 40))} for k in range(rows)]
    return DataConfig(source="jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", rows)), stream=ON, **extra)


def sampler_for(cfg: DataConfig, tokenizer, rank=0, world=1, window=4, budget=256, holdout=(0.0, 0)):
    stream = ExampleStream(cfg, tokenizer, budget, rank, world, holdout)
    return StreamingSampler(stream, PackingConfig(balance="tokens", token_budget=budget), window, rank, world)


def bins_of(sampler: StreamingSampler, n: int) -> list[list[list[int]]]:
    out = []
    for _ in range(n):
        _, ids, _ = sampler.next_microbatch()
        out.append([sampler.served[int(i)][0].tolist() for i in ids])
    return out


def test_uneven_shards_still_give_every_rank_the_same_number_of_micro_batches(tmp_path, tokenizer):
    """7 rows on 2 ranks: rank 0 holds 4, rank 1 holds 3. A share that runs out starts its next pass, so
    both serve any number of micro-batches (the run's length is max_steps), each only its own rows."""
    cfg = stream_cfg(tmp_path)
    samplers = [sampler_for(cfg, tokenizer, r, 2, window=2) for r in range(2)]
    served = [bins_of(s, 12) for s in samplers]
    assert [len(x) for x in served] == [12, 12] and all(b for x in served for b in x)
    assert min(s.stream.passes for s in samplers) >= 1
    rows = [set(map(tuple, (t for b in x for t in b))) for x in served]
    assert len(rows[0]) == 4 and len(rows[1]) == 3 and not rows[0] & rows[1]


def saved_dataset(path, rows: int):
    import datasets

    texts = [f"row {k} " + "word " * (k % 9) for k in range(rows)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))
    return DataConfig(source="hf", path=str(path), stream=ON)


@pytest.mark.parametrize("source", ["jsonl", "hf", "dailydialog_synthetic"])
def test_state_round_trip_continues_with_identical_micro_batches(tmp_path, tokenizer, source, monkeypatch):
    monkeypatch.setattr(streaming, "STREAM_CHUNK", 4)  # positions inside a file, not only at its end
    cfg = {
        "jsonl": lambda: stream_cfg(tmp_path, rows=41),
        "hf": lambda: saved_dataset(tmp_path / "saved", 41),
        "dailydialog_synthetic": lambda: DataConfig(num_records=60, stream=ON),
    }[source]()
    first = sampler_for(cfg, tokenizer, 1, 2, window=5)
    while first.stream.passes == 0:  # save inside the second pass: a pass boundary was crossed
        bins_of(first, 1)
    bins_of(first, 2)
    first.save_rank_state(tmp_path / "rank.safetensors")
    saved = first.state_dict()
    expected = bins_of(first, 9)

    resumed = sampler_for(cfg, tokenizer, 1, 2, window=5)
    resumed.load_state_dict(saved)
    resumed.load_rank_state(tmp_path / "rank.safetensors")
    assert bins_of(resumed, 9) == expected
    assert resumed.stream.stats == first.stream.stats


def test_resume_refuses_another_world_size_or_window(tmp_path, tokenizer):
    cfg = stream_cfg(tmp_path)
    saved = sampler_for(cfg, tokenizer, 0, 2).state_dict()
    with pytest.raises(ValueError, match="world size it was saved on"):
        sampler_for(cfg, tokenizer, 0, 1).load_state_dict(saved)
    with pytest.raises(ValueError, match="data.stream.buffer"):
        sampler_for(cfg, tokenizer, 0, 2, window=9).load_state_dict(saved)


def test_bad_rows_are_named_counted_and_truncation_counted(tmp_path, tokenizer, caplog):
    rows = [{"text": "fine words here"}, {"messages": [{"role": "wizard", "content": "x"}]}, {"text": "w " * 400}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    cfg = DataConfig(source="jsonl", path=str(path), stream=ON, columns={"text": "text"})
    with pytest.raises(ValueError):  # a row without the mapped column under on_bad_record=error
        sampler_for(replace(cfg, columns={"messages": "messages"}), tokenizer).next_microbatch()
    skip = replace(cfg, on_bad_record="skip", columns={"messages": "messages"})
    with caplog.at_level(logging.WARNING):
        stream = ExampleStream(skip, tokenizer, 64)
        with pytest.raises(ValueError, match="no training example"):
            stream.next_chunk()
    # datasets gives every row every column of the file (None where absent): rows 1 and 3 have no messages
    assert (stream.stats.dropped_bad, stream.stats.dropped_empty) == (1, 2) and f"{path}:2" in caplog.text

    stream = ExampleStream(cfg, tokenizer, 64)
    stream.next_chunk()
    assert stream.stats.truncated == 1 and stream.stats.dropped_empty == 1 and stream.stats.examples == 2


def test_a_file_datasets_cannot_parse_is_an_error_or_a_counted_skip(tmp_path, tokenizer, monkeypatch):
    from trainer.data import parts

    monkeypatch.setattr(parts, "SMALL_FILE_BYTES", 0)  # streamed one by one, as files of a megabyte or more are
    (tmp_path / "a.jsonl").write_text('{"text": "one two"}\n{"text": "broken"\n')
    write_jsonl(tmp_path / "b.jsonl", [{"text": "three four five"}])
    cfg = DataConfig(source="jsonl", path=str(tmp_path), stream=ON)
    with pytest.raises(BadRecordError, match="a.jsonl: not readable as a stream"):
        ExampleStream(cfg, tokenizer, 64).next_chunk()
    stream = ExampleStream(replace(cfg, on_bad_record="skip"), tokenizer, 64)
    assert len(stream.next_chunk()) == 1 and stream.stats.dropped_bad == 1


def test_held_out_examples_never_train_and_form_the_eval_set(tokenizer):
    cfg = DataConfig(num_records=200, stream=StreamConfig(enabled=True, eval_records=200))
    holdout = (0.2, 0)
    eval_set, probe = head_sets(cfg, tokenizer, 512, holdout, None)
    assert eval_set is not None and holdout_mask(eval_set, *holdout).all()
    assert len(probe) and not holdout_mask(probe, *holdout).any()
    stream = ExampleStream(cfg, tokenizer, 512, holdout=holdout)
    seen = [tuple(t.tolist()) for t, _ in stream.next_chunk()]  # the whole pass: 200 records, one chunk
    held = {tuple(eval_set.example(i)[0].tolist()) for i in range(len(eval_set))}
    assert not held & set(seen) and stream.held_out == len(eval_set)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_steps": None}, "set max_steps"),
        ({"packing": PackingConfig(balance="tokens", strategy="wrapped")}, "packing.strategy=wrapped"),
        (
            {"data": DataConfig(stream=ON, mixture=MixtureConfig(sources=[{"source": "chat_synthetic"}]))},
            "data.mixture.sources",
        ),
        ({"data": DataConfig(stream=ON, limit=10)}, "data.limit"),
        ({"data": DataConfig(stream=ON, source="hf", path="some/dataset")}, "model.tokenizer=local_bpe"),
    ],
)
def test_impossible_streaming_configs_are_refused_in_one_line(change, message):
    cfg = replace(JobConfig(data=DataConfig(stream=ON), max_steps=5), **change)
    with pytest.raises(ConfigError, match=message) as e:
        cfg.validate()
    assert "\n" not in str(e.value)


def test_the_chat_recipe_streams_with_one_override_and_analyze_refuses_a_stream(capsys):
    from tests.conftest import compose_job
    from trainer.tools import analyze

    cfg = compose_job(["recipe=cpu_chat_sft", "data.stream.enabled=true"])
    assert cfg.data.stream.enabled and cfg.max_steps and cfg.data.stream.buffer == 2048
    with pytest.raises(SystemExit):
        analyze.main(["recipe=cpu_chat_sft", "data.stream.enabled=true"])
    assert capsys.readouterr().err.startswith("packfsdp: config error: analyze reports on the whole dataset")


def test_a_datasets_source_is_split_between_ranks_by_node(tmp_path, tokenizer):
    """``hf`` (here a ``save_to_disk`` folder, as a hub id would be): ``split_dataset_by_node`` deals the
    rows; the two ranks' first passes are disjoint and cover every row."""
    cfg = saved_dataset(tmp_path / "saved", 30)
    passes = []
    for rank in range(2):
        stream, seen = ExampleStream(cfg, tokenizer, 256, rank, 2), []
        while stream.passes == 0:
            seen += [tuple(t.tolist()) for t, _ in stream.next_chunk()]
        passes.append(set(seen))
    assert not passes[0] & passes[1] and len(passes[0] | passes[1]) == 30


def test_a_streamed_csv_reads_cells_as_the_cached_path_does_and_names_bad_rows_by_line(tmp_path, tokenizer, caplog):
    """Cells stay strings ("007" is not the number 7), as on the cached Arrow path, and a bad row is named
    ``file:line`` by the line its row ends on (the first row's quoted cell spans two lines)."""
    path = tmp_path / "d.csv"
    path.write_text('prompt,response\n007,"line one\nline two"\nhello,there\n')
    cfg = DataConfig(source="csv", path=str(path), stream=ON)
    stream = ExampleStream(cfg, tokenizer, 64)
    first = stream.next_chunk()[0][0]
    assert "007" in tokenizer.decode(first) and stream.stats.examples == 2
    bad = tmp_path / "chats.csv"
    bad.write_text(
        'messages\n"[{""role"": ""user"", ""content"": ""hi""},\n'  # row 1 spans lines 2-3
        '{""role"": ""assistant"", ""content"": ""yo""}]"\n"[{""role"": ""wizard"", ""content"": ""x""}]"\n'
    )
    with caplog.at_level(logging.WARNING):
        stream = ExampleStream(replace(cfg, path=str(bad), on_bad_record="skip"), tokenizer, 64)
        stream.next_chunk()
    assert stream.stats.dropped_bad == 1 and f"{bad}:4" in caplog.text
