"""``distill.teacher_logits=precompute``'s store: one pass writes every label token's top-k, a batch of any layout
(packed whole, split pieces, padded, a held-out view) reads back exactly the rows the teacher gives it live; a
second run reads the store instead of computing; a store that fails its checksums is computed again."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer.collate import collate_packed, collate_padded
from trainer.config import DataConfig
from trainer.data import load_dataset
from trainer.data.examples import IGNORE_INDEX
from trainer.data.holdout import split_holdout
from trainer.evaluate import eval_microbatches
from trainer.loss import LogitTransform, label_positions
from trainer.objectives.distill import topk
from trainer.objectives.distill.topk import STORE_PREFIX, precompute_top_k, top_k_rows

CPU = torch.device("cpu")
K, VOCAB, WIDTH = 5, 64, 8


class PositionalTeacher:
    """A stand-in teacher whose logits at a position depend on its token and its position in the example, so a
    row read for the wrong token or offset shows."""

    def __init__(self, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens, self.positions = torch.randn(vocab, WIDTH, generator=g), torch.randn(1024, WIDTH, generator=g)
        self.head = torch.randn(VOCAB, WIDTH, generator=g)
        self.calls = 0

    def __call__(self, batch):
        self.calls += 1
        hidden = self.tokens[batch.input_ids] + self.positions[batch.position_ids]
        hidden, _ = label_positions(hidden, batch.labels)
        return top_k_rows(hidden, self.head, None, LogitTransform(), 1.5, K, chunk=7)


@pytest.fixture(scope="module")
def chats(tokenizer, tmp_path_factory):
    cfg = DataConfig(source="chat_synthetic", num_records=40, cache_dir=str(tmp_path_factory.mktemp("cache")))
    return load_dataset(cfg, tokenizer, max_length=512)


def batches(lengths):
    return eval_microbatches(lengths, 700, 0, 1)


def test_store_round_trip(chats, tokenizer):
    teacher = PositionalTeacher(len(tokenizer))
    train, held = split_holdout(chats, 0.25, seed=3)
    store = precompute_top_k(teacher, train, "abc", K, VOCAB, batches, collate_packed, CPU)
    assert store.folder == chats.folder / f"{STORE_PREFIX}abc" and teacher.calls > 1
    assert len(store.ids) == int(chats.label_counts().sum()) and store.ids.shape[1] == K
    pieces = np.array([[3, 5, 40], [0, 0, 9], [3, 40, int(train.lengths[3])], [1, 0, int(train.lengths[1])]])
    layouts = [
        (train, collate_packed(train, np.arange(6))),
        (train, collate_packed(train, pieces)),
        (held, collate_padded(held, np.arange(3), 0)),
        (held, collate_packed(held, np.array([], dtype=np.int64))),
    ]
    for dataset, batch in layouts:
        assert (batch.labels != IGNORE_INDEX).any() or batch.num_examples == 0
        want = teacher(batch)
        got = store.teacher(dataset, batch, CPU)
        torch.testing.assert_close(got.ids, want[0].long())
        torch.testing.assert_close(got.log_probs_k, want[1])
        torch.testing.assert_close(got.log_rest, want[2])


def test_second_run_reads_and_a_damaged_store_is_computed_again(chats, tokenizer, caplog):
    teacher = PositionalTeacher(len(tokenizer))
    first = precompute_top_k(teacher, chats, "again", K, VOCAB, batches, collate_packed, CPU)
    calls = teacher.calls
    precompute_top_k(teacher, chats, "again", K, VOCAB, batches, collate_packed, CPU)
    assert teacher.calls == calls  # read, not computed
    with open(first.folder / "log_probs.npy", "r+b") as f:  # one byte changed in place
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 1]))
    store = precompute_top_k(teacher, chats, "again", K, VOCAB, batches, collate_packed, CPU)
    assert teacher.calls > calls and "does not verify" in caplog.text
    batch = collate_packed(chats, np.arange(4))
    torch.testing.assert_close(store.teacher(chats, batch, CPU).log_probs_k, teacher(batch)[1])


def test_a_store_for_other_settings_is_refused(chats, tokenizer):
    teacher = PositionalTeacher(len(tokenizer))
    store = precompute_top_k(teacher, chats, "shape", K, VOCAB, batches, collate_packed, CPU)
    rows = len(store.ids)
    assert topk.store_problem(store.folder, rows, K, VOCAB) is None
    assert "ask for" in topk.store_problem(store.folder, rows, K + 1, VOCAB)
    assert "outside the vocabulary" in topk.store_problem(store.folder, rows, K, 3)


def test_top_k_rows_keep_the_whole_distribution():
    g = torch.Generator().manual_seed(1)
    hidden, head = torch.randn(9, WIDTH, generator=g), torch.randn(VOCAB, WIDTH, generator=g)
    ids, values, rest = top_k_rows(hidden, head, None, LogitTransform(), 0.7, K, chunk=4)
    full = F.log_softmax(F.linear(hidden, head) / 0.7, -1)
    torch.testing.assert_close(values, full.gather(1, ids.long()))
    assert (values[:, :-1] >= values[:, 1:]).all()
    torch.testing.assert_close(torch.logaddexp(values.logsumexp(-1), rest), torch.zeros(9), atol=1e-6, rtol=0)
