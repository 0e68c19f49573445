"""The sections that say what is trained on what: ``data``, ``model``, ``packing``, ``parallel``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config.common import (
    ATTENTION_BACKENDS,
    CP_SPLITS,
    DTYPE_NAMES,
    LOCAL_PATH_PREFIXES,
    PACKING_STRATEGIES,
    WORK_MEASURES,
    ConfigError,
    check_choice,
    check_folder,
    check_positive,
)


@dataclass
class StreamConfig:
    """``data.stream``: the stream sink (``trainer.data.stream``, ``trainer.packing.online``)."""

    enabled: bool = False
    """Read the source as a stream (``datasets`` ``streaming=True``), rendered on the fly and packed online:
    for data larger than memory or disk. Nothing is cached; needs ``max_steps`` (a stream has no known
    length; each rank's share is read again when it ends)."""
    buffer: int = 2048
    """Examples the online packer chooses each bin from (more: fuller bins, more memory)."""
    eval_records: int = 2000
    """The eval set is the held-out examples (``eval.holdout_fraction``) among the stream's first this many
    records."""

    def validate(self) -> None:
        check_positive("data.stream.buffer", self.buffer)
        check_positive("data.stream.eval_records", self.eval_records)


@dataclass
class MixtureConfig:
    """``data.mixture``: several sources in one training set (``trainer.data.mixture``)."""

    sources: list[dict[str, Any]] = field(default_factory=list)
    """Each item sets one source's data fields (``source``, ``path``, ``columns``, ...; the others come from
    ``data``) and its ``weight`` (share of the mixture). Empty: the one source of ``data``."""
    by: str = "examples"
    """What the weights share out: ``examples`` or ``tokens``."""

    def validate(self) -> None:
        check_choice("data.mixture.by", self.by, ("examples", "tokens"))


@dataclass
class DataConfig:
    source: str = "dailydialog_synthetic"
    """Registered data source name (see ``trainer.data.sources.SOURCES``)."""
    path: str | None = None
    """Local file or directory for file-based sources; a hub id for hub sources."""
    split: str = "train"
    """Split to read where the source has splits."""
    subset: str | None = None
    """Hub sources: the dataset's configuration name (``datasets.load_dataset(path, subset)``)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Column mapping for table sources (jsonl, parquet, csv, hf): packfsdp field -> your column. Fields:
    ``text``, ``messages``, ``turns``, ``prompt`` + ``response`` (+ ``system``), and ``role`` / ``content``
    (keys inside each message). Empty: detected from the column names (see ``trainer.data.tables.detect_columns``)."""
    roles: dict[str, str] = field(default_factory=dict)
    """Renames message roles to ``system`` / ``user`` / ``assistant`` (e.g. ``{human: user, gpt: assistant}``)."""
    plugins: list[str] = field(default_factory=list)
    """Python modules imported before the source is looked up, so they can ``register_source`` their own
    formats: dotted module names (importable from the working directory) or paths to ``.py`` files."""
    num_records: int = 13118
    """Generated sources only (``dailydialog_synthetic``: dialogs, ``chat_synthetic``: chats): how many records
    to generate."""
    loss_on: str = "auto"
    """Which tokens carry loss: ``auto`` (chat: assistant messages only; dialogs and documents: all),
    ``responses`` (chat: assistant messages; dialogs: every second turn, the replies) or ``all``."""
    max_length: int = 1024
    """Longest example in tokens; longer ones follow ``overlong``. Clamped to the model's context."""
    overlong: str = "truncate"
    """What to do with an example longer than ``max_length``: ``truncate`` or ``drop`` (counted either way)."""
    limit: int | None = None
    """Use only the first ``limit`` examples (quick experiments)."""
    on_bad_record: str = "error"
    """A malformed line or record (bad JSON, not UTF-8, a missing column, an unknown chat role, an empty
    file): ``error`` names its file and line; ``skip`` leaves it out, counted and logged."""
    seed: int = 1234
    """Seeds which records there are: the generated sources' corpus and the mixture's draw (``data.mixture``);
    part of the data cache's key. Training's randomness is the top-level ``seed`` (see there)."""
    cache_dir: str = "${oc.env:PACKFSDP_CACHE,'~/.cache/packfsdp'}"
    """Where the locally trained tokenizer and tokenized datasets are cached."""
    max_record_bytes: int = 8 << 20
    """A record larger than this (its text in UTF-8 bytes, token ids at 4 bytes each) is skipped before it
    is tokenized or sampled for the local tokenizer, counted and logged: input memory stays bounded (one 200 MB
    line grew a rank past 11 GB). 8 MiB is ~2M tokens of text, past any ``max_length``."""
    num_proc: int | None = None
    """Processes that render and tokenize a table source (a ``datasets`` map); ``None``: the cores this job
    may use. Inputs under 20k rows are done in-process. Does not change the result (not in the cache key)."""
    stream: StreamConfig = field(default_factory=StreamConfig)
    """Reading the source as a stream (``data.stream.enabled``, ``buffer``, ``eval_records``)."""
    mixture: MixtureConfig = field(default_factory=MixtureConfig)
    """Several sources in one training set (``data.mixture.sources``, ``by``)."""

    def validate(self) -> None:
        check_choice("data.loss_on", self.loss_on, ("auto", "responses", "all"))
        check_choice("data.overlong", self.overlong, ("truncate", "drop"))
        check_choice("data.on_bad_record", self.on_bad_record, ("error", "skip"))
        check_positive("data.max_length", self.max_length)
        check_positive("data.num_records", self.num_records)
        check_positive("data.max_record_bytes", self.max_record_bytes)
        if os.environ.get("PACKFSDP_CACHE"):  # data.cache_dir's default; the config verdicts are cached there too
            check_folder("PACKFSDP_CACHE", os.environ["PACKFSDP_CACHE"])
        check_folder("data.cache_dir", self.cache_dir)
        if self.limit is not None:
            check_positive("data.limit", self.limit)
        if self.num_proc is not None:
            check_positive("data.num_proc", self.num_proc)
        self.stream.validate()
        self.mixture.validate()


@dataclass
class ModelConfig:
    name_or_path: str | None = None
    """Hub id or local directory of pretrained weights (family, tokenizer, chat template and context length
    are read from it; ``model=hf`` is the group for it). ``None`` builds a randomly initialised model from
    ``family`` and ``random_init``."""
    family: str = "gpt2"
    """transformers ``model_type`` used when building from a config (gpt2, llama, qwen2, ...); a loaded
    model's family is the one its folder states."""
    random_init: dict[str, Any] = field(default_factory=dict)
    """Config fields of the randomly initialised model a preset builds (its sizes). Never applied to a
    model loaded from ``name_or_path``, so a preset's sizes cannot leak into your model."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields you set on the transformers config, of a loaded model or a built one (dropout, context,
    sizes on top of ``random_init``). Presets leave it empty: whatever is here, you asked for."""
    tokenizer: str | None = "local_bpe"
    """``local_bpe`` trains a byte-level BPE tokenizer on the data and caches it (for randomly initialised
    models only: a loaded model uses its folder's tokenizer); anything else is a hub id or local directory
    passed to ``AutoTokenizer.from_pretrained``. ``null`` means ``name_or_path``."""
    tokenizer_vocab_size: int = 4096
    """Vocabulary size of the locally trained tokenizer."""
    attention: str = "auto"
    """Attention backend for packed batches: ``auto`` or one of ``ATTENTION_BACKENDS`` (``flash_attn``,
    ``torch_varlen``, ``flex``, ``sdpa_varlen``, ``sdpa_block_mask``; see ``trainer.model.attention``)."""
    self_check: bool = True
    """Before step 1, run one real micro-batch as built and example by example; stop on a mismatch."""
    self_check_tolerance: float | None = None
    """Max |logit difference| (relative to the largest logit) the self-check allows; ``None``: by dtype."""
    dtype: str = "float32"
    """dtype of the master weights (the optimizer's copy). Compute dtype is ``parallel.param_dtype``."""
    trust_remote_code: bool = False
    """Passed to ``from_pretrained``; off unless you trust the model repository."""
    chat_template: str | None = None
    """How chat records (``messages``) are rendered: ``null`` uses the tokenizer's own template (else the
    built-in ``default``); ``default`` (``role:\\n content EOS``), ``chatml`` (Qwen's format; the local BPE
    then gets ``<|im_start|>``/``<|im_end|>`` as special tokens) or a Jinja string replace it."""

    def tokenizer_name(self) -> str:
        """The tokenizer this model uses: ``local_bpe`` (trained on the data) for a random model, else a
        hub id or folder. A loaded model always gets a real tokenizer: ``local_bpe`` would not match its
        embeddings, so there it means ``name_or_path``'s own."""
        if self.name_or_path and self.tokenizer in (None, "local_bpe"):
            return self.name_or_path
        assert self.tokenizer is not None, "validate() refuses a model with neither tokenizer nor name_or_path"
        return self.tokenizer

    def init_fields(self) -> dict[str, Any]:
        """The config fields set on the model: ``config_overrides`` for a loaded model, ``random_init``
        updated by ``config_overrides`` for a built one."""
        if self.name_or_path:
            return dict(self.config_overrides)
        return dict(self.random_init) | dict(self.config_overrides)

    def validate(self) -> None:
        if self.tokenizer is None and not self.name_or_path:
            raise ConfigError(
                "model.name_or_path must be set: a local model folder or a hub id (model=hf: "
                "model.name_or_path=/path/to/model); or name a tokenizer with model.tokenizer=..."
            )
        if self.name_or_path and self.name_or_path.startswith(LOCAL_PATH_PREFIXES):
            folder = Path(self.name_or_path).expanduser()
            if not folder.is_dir():
                raise ConfigError(f"model.name_or_path={self.name_or_path}: no such folder")
        check_choice("model.dtype", self.dtype, DTYPE_NAMES)
        check_choice("model.attention", self.attention, ("auto", *ATTENTION_BACKENDS))
        check_positive("model.tokenizer_vocab_size", self.tokenizer_vocab_size)


@dataclass
class PackingConfig:
    strategy: str = "bfd"
    """How examples become micro-batches (see ``trainer.packing.strategies``): ``none`` (padded baseline:
    shuffled, padded to the longest), ``sorted`` (length-grouped padded), ``ffd`` / ``bfd`` (first-/best-fit
    decreasing over the whole dataset, whole examples), ``bfd_split`` (bfd; longer examples cut into pieces
    across bins) or ``wrapped`` (concatenate, then cut every ``token_budget`` tokens)."""
    token_budget: int = 2048
    """Tokens per packed micro-batch. The padded baselines take as many examples per micro-batch as a
    packed micro-batch holds on average, so both see the same useful tokens per step."""
    max_examples_per_bin: int | None = None
    """Cap on examples (or pieces) in one packed micro-batch (``None``: no cap)."""
    shuffle: bool = True
    """Shuffle the order of micro-batches (packed bins or padded batches) every epoch, after packing."""
    padded_batch_size: int | None = None
    """Padded strategies only: examples per micro-batch. ``None`` matches the packed run (see above)."""
    balance: str = "flops"
    """What the ranks are balanced on per step: ``flops`` (the default: each example's model FLOPs, the MLP's
    linear term and attention's quadratic one, from the model's config: ``trainer.packing.balance.TokenCost``;
    the best balance measured on long-tailed data, docs/packing.md), ``tokens`` or ``attention`` (sum of
    squared lengths)."""
    megabatch_factor: int = 50
    """``sorted`` only: sort by length inside random groups of ``megabatch_factor x batch size`` examples."""

    def validate(self) -> None:
        check_choice("packing.strategy", self.strategy, tuple(PACKING_STRATEGIES))
        check_choice("packing.balance", self.balance, WORK_MEASURES)
        check_positive("packing.token_budget", self.token_budget)
        if self.token_budget < (least := PACKING_STRATEGIES[self.strategy].min_budget):
            raise ConfigError(f"packing.token_budget must be >= {least} for strategy {self.strategy}")
        if self.max_examples_per_bin is not None:
            check_positive("packing.max_examples_per_bin", self.max_examples_per_bin)
        if self.padded_batch_size is not None:
            check_positive("packing.padded_batch_size", self.padded_batch_size)
        check_positive("packing.megabatch_factor", self.megabatch_factor)

    @property
    def packed(self) -> bool:
        """Flat varlen micro-batches (``collate_packed``) rather than padded rectangles."""
        return not PACKING_STRATEGIES[self.strategy].padded

    @property
    def splits_examples(self) -> bool:
        """May cut an example into pieces, so examples need not fit the budget."""
        return PACKING_STRATEGIES[self.strategy].splits


@dataclass
class ParallelConfig:
    backend: str = "auto"
    """Process-group backend: ``auto`` (nccl on CUDA, gloo on CPU), ``nccl`` or ``gloo``. With ``cpu_offload`` on
    CUDA, ``auto``/``nccl`` become ``cuda:nccl,cpu:gloo`` (CPU-resident gradients need a CPU backend)."""
    device: str = "auto"
    """``auto`` (CUDA when available), ``cuda`` or ``cpu``."""
    param_dtype: str = "bfloat16"
    """MixedPrecisionPolicy: dtype of the all-gathered parameters used for compute."""
    reduce_dtype: str = "float32"
    """MixedPrecisionPolicy: dtype of the gradient reduce-scatter."""
    output_dtype: str | None = None
    """MixedPrecisionPolicy: dtype the root module's outputs are cast to (``None``: leave them)."""
    reshard_after_forward: bool = True
    """Free the gathered parameters after forward (ZeRO-3); ``False`` keeps them until backward (ZeRO-2)."""
    dp_replicate: int | None = None
    """``None``: FSDP over all ranks (1-D mesh). An integer R: HSDP on a 2-D mesh, the model replicated R
    times (set it to the number of nodes) and sharded over the ``world_size / R`` ranks of each replica."""
    activation_checkpointing: str = "none"
    """Recompute block activations in backward: ``none``, ``full`` (every block) or ``every_k``."""
    activation_checkpointing_every: int = 2
    """With ``every_k``: checkpoint blocks 0, k, 2k, ... (trades less memory saved for less recompute)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and the optimizer step on the CPU (FSDP2 ``CPUOffloadPolicy``)."""
    compile: bool = False
    """``torch.compile`` each transformer block's forward."""
    compile_backend: str = "inductor"
    """Backend for ``compile`` (``inductor``; ``aot_eager`` compiles fast, for tests and debugging)."""
    cp: int = 1
    """Context-parallel degree C: each packed row holds ``C x packing.token_budget`` tokens and is sharded along
    the sequence over C neighbouring ranks (``trainer.parallel``); the world is dp x cp, cp innermost."""
    cp_split: str = "balanced"
    """How a row is cut over the CP group: ``contiguous`` (equal slices) or ``balanced`` (head/tail zigzag per
    long example, short ones placed by attention cost: about equal attention work per rank)."""

    def validate(self) -> None:
        check_positive("parallel.cp", self.cp)
        check_choice("parallel.cp_split", self.cp_split, CP_SPLITS)
        check_choice("parallel.activation_checkpointing", self.activation_checkpointing, ("none", "full", "every_k"))
        check_positive("parallel.activation_checkpointing_every", self.activation_checkpointing_every)
        if self.dp_replicate is not None:
            check_positive("parallel.dp_replicate", self.dp_replicate)
        check_choice("parallel.backend", self.backend, ("auto", "nccl", "gloo"))
        check_choice("parallel.device", self.device, ("auto", "cuda", "cpu"))
        for key in ("param_dtype", "reduce_dtype"):
            check_choice(f"parallel.{key}", getattr(self, key), DTYPE_NAMES)
        if self.output_dtype is not None:
            check_choice("parallel.output_dtype", self.output_dtype, DTYPE_NAMES)
