"""Tokenizers: a byte-level BPE trained locally (the offline default) or any pretrained one.

The local tokenizer is trained once with ``tokenizers`` on the source's text, saved in the
``save_pretrained`` layout under the cache directory keyed by a hash of what it was trained on, and loaded
from there afterwards. It uses GPT-2's conventions: byte-level pre-tokenisation and one special token,
``<|endoftext|>``, which serves as BOS, EOS, turn separator and pad.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from trainer.data.cache_integrity import build_lock
from trainer.distributed import on_rank0_then_all

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, extra_special_tokens: list[str] | None = None
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (``extra_special_tokens``: e.g. ChatML's markers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, *(extra_special_tokens or [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS,
        additional_special_tokens=list(extra_special_tokens or []),
    )


def local_tokenizer(
    texts: Callable[[], Iterable[str]],
    vocab_size: int,
    cache_dir: str | Path,
    cache_key: str,
    extra_special_tokens: list[str] | None = None,
) -> PreTrainedTokenizerBase:
    """Load the cached local tokenizer for ``cache_key``, training (on rank 0) and caching it first if needed.

    ``texts`` is called only on a cache miss and may be an iterator (the texts are streamed into the
    trainer, never held together); ``cache_key`` names what the texts are (source, seed, size, sample) and,
    with the vocab size, selects the cache entry.
    """
    key = [cache_key, vocab_size] + ([extra_special_tokens] if extra_special_tokens else [])
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    path = Path(cache_dir) / "tokenizers" / f"bpe-{vocab_size}-{digest}"

    def train_into_cache() -> None:
        with build_lock(path):  # two jobs at once: one trains, the other waits and reuses it
            if (path / "tokenizer.json").is_file():
                return
            log.info("training a byte-level BPE tokenizer (vocab %d)", vocab_size)
            tokenizer = train_bpe_tokenizer(texts(), vocab_size, extra_special_tokens)
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(path, ignore_errors=True)  # an incomplete one (no tokenizer.json)
            tmp.rename(path)  # atomic: a half-written tokenizer is never picked up

    on_rank0_then_all(train_into_cache)  # a bad data path fails on every rank, not only on rank 0
    return AutoTokenizer.from_pretrained(path)


def pretrained_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A pretrained tokenizer from the hub or a local directory; gives it a pad token if it has none."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path!r} has no EOS token; packfsdp needs one as turn separator")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
