"""Typed configuration: one dataclass per component (every field, its type, its meaning, its checks).

YAML files under ``configs/`` only set values; the schema, defaults and docs live here. ``trainer.compose``
registers it in Hydra's ConfigStore and turns the composed ``DictConfig`` into a ``JobConfig`` once
(``to_job_config``); nothing below ``main()`` sees a ``DictConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

# Light registries (numpy only): the choice lists and strategy facts below come from them.
from trainer.packing.balance import WORK_MEASURES
from trainer.packing.strategies import OVERSIZE_RULES, STRATEGIES, get_strategy

ATTENTION_BACKENDS = ("flash_attn", "torch_varlen", "flex", "sdpa_varlen", "sdpa_block_mask")
"""The packed attention backends ``model.attention`` may name besides ``auto``, in the order ``auto`` tries
them (fastest first). ``trainer.model.attention.BACKENDS`` registers exactly these; the names live here so
that validating a config never imports torch."""

CODE_OPTIONS = {"data.plugins": "PACKFSDP_PLUGINS", "model.trust_remote_code": "PACKFSDP_TRUST_REMOTE_CODE"}
"""Options that import user or remote code, and the environment variable that may set each instead of the
command line (a config file may not: ``trainer.cli.check_code_sources``). ``PACKFSDP_PLUGINS`` is a
comma-separated list added to ``data.plugins``; ``PACKFSDP_TRUST_REMOTE_CODE=1`` sets the flag."""

LOSS_IMPLS = ("chunked", "naive")
"""``loss.impl`` choices (``trainer.loss``): the LM head fused with the cross-entropy in chunks of tokens, or
the model's full logits then cross-entropy."""

CONTEXT_KEYS = ("n_positions", "max_position_embeddings")
"""Where a transformers config states the model's context length (GPT-2 names it ``n_positions``)."""


def stated_context(config: Any) -> int | None:
    """The context length a transformers config states, or ``None``. ``config`` is a transformers config
    (of a built model, or read without weights) or a plain dict of its fields (``ModelConfig.init_fields``)."""
    for key in CONTEXT_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if value:
            return int(value)
    return None


LOCAL_PATH_PREFIXES = ("/", "./", "../", "~")
"""A ``name_or_path`` starting so is a local folder (a hub id never does), checked to exist at once."""


GENERATED_SOURCES = ("dailydialog_synthetic", "chat_synthetic")
"""The sources ``trainer.data.sources`` generates offline (small: the local BPE may train on them even when
they are streamed)."""


class ConfigError(ValueError):
    """A configuration value is wrong. The message says which key and what to change."""


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
    (keys inside each message). Empty: detected from the column names (see ``trainer.data.sources``)."""
    roles: dict[str, str] = field(default_factory=dict)
    """Renames message roles to ``system`` / ``user`` / ``assistant`` (e.g. ``{human: user, gpt: assistant}``)."""
    plugins: list[str] = field(default_factory=list)
    """Python modules imported before the source is looked up, so they can ``register_source`` their own
    formats: dotted module names (importable from the working directory) or paths to ``.py`` files."""
    num_dialogs: int = 13118
    """Synthetic source only: how many dialogs to generate."""
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
    """Seed of the synthetic generator (the corpus is a pure function of it)."""
    cache_dir: str = "${oc.env:PACKFSDP_CACHE,'~/.cache/packfsdp'}"
    """Where the locally trained tokenizer and tokenized datasets are cached."""
    mix: list[dict[str, Any]] = field(default_factory=list)
    """Several sources in one training set: each item sets one source's data fields (``source``, ``path``,
    ``columns``, ...; the others come from ``data``) and its ``weight`` (share of the mixture; see
    ``trainer.data.mixture``). Empty: the one source above."""
    mix_by: str = "examples"
    """What the ``data.mix`` weights share out: ``examples`` or ``tokens``."""
    num_proc: int | None = None
    """Processes that render and tokenize a table source (a ``datasets`` map); ``None``: the cores this job
    may use. Inputs under 20k rows are done in-process. Does not change the result (not in the cache key)."""
    streaming: bool = False
    """Read the source as a stream (``datasets`` ``streaming=True``), rendered on the fly and packed online
    (``trainer.data.streaming``, ``trainer.packing.online``): for data larger than memory or disk. Nothing is
    cached; needs ``max_steps`` (a stream has no known length; each rank's share is read again when it ends)."""
    stream_buffer: int = 2048
    """Streaming: examples the online packer chooses each bin from (more: fuller bins, more memory)."""
    stream_eval_records: int = 2000
    """Streaming: the eval set is the held-out examples (``eval.holdout_fraction``) among the stream's first
    this many records."""

    def validate(self) -> None:
        _choice("data.loss_on", self.loss_on, ("auto", "responses", "all"))
        _choice("data.overlong", self.overlong, ("truncate", "drop"))
        _choice("data.on_bad_record", self.on_bad_record, ("error", "skip"))
        _choice("data.mix_by", self.mix_by, ("examples", "tokens"))
        _positive("data.max_length", self.max_length)
        _positive("data.num_dialogs", self.num_dialogs)
        if self.limit is not None:
            _positive("data.limit", self.limit)
        if self.num_proc is not None:
            _positive("data.num_proc", self.num_proc)
        _positive("data.stream_buffer", self.stream_buffer)
        _positive("data.stream_eval_records", self.stream_eval_records)


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
        _choice("model.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        _choice("model.attention", self.attention, ("auto", *ATTENTION_BACKENDS))
        _positive("model.tokenizer_vocab_size", self.tokenizer_vocab_size)


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
    oversize: str = "error"
    """``bfd``/``ffd``: an example longer than ``token_budget`` is an ``error`` or is ``drop``-ped (counted,
    logged). The trainer truncates examples to the budget first (``data.overlong``), so this guards other
    callers; ``bfd_split`` and ``wrapped`` cut such examples instead."""
    balance: str = "tokens"
    """What the ranks are balanced on per step: ``tokens`` or ``attention`` (sum of squared lengths)."""
    megabatch_factor: int = 50
    """``sorted`` only: sort by length inside random groups of ``megabatch_factor x batch size`` examples."""

    def validate(self) -> None:
        _choice("packing.strategy", self.strategy, tuple(STRATEGIES))
        _choice("packing.oversize", self.oversize, OVERSIZE_RULES)
        _choice("packing.balance", self.balance, tuple(WORK_MEASURES))
        _positive("packing.token_budget", self.token_budget)
        if self.token_budget < (least := get_strategy(self.strategy).min_budget):
            raise ConfigError(f"packing.token_budget must be >= {least} for strategy {self.strategy}")
        if self.max_examples_per_bin is not None:
            _positive("packing.max_examples_per_bin", self.max_examples_per_bin)
        if self.padded_batch_size is not None:
            _positive("packing.padded_batch_size", self.padded_batch_size)
        _positive("packing.megabatch_factor", self.megabatch_factor)

    @property
    def packed(self) -> bool:
        """Flat varlen micro-batches (``collate_packed``) rather than padded rectangles."""
        return not get_strategy(self.strategy).padded

    @property
    def splits_examples(self) -> bool:
        """May cut an example into pieces, so examples need not fit the budget."""
        return get_strategy(self.strategy).splits


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

    def validate(self) -> None:
        _choice("parallel.activation_checkpointing", self.activation_checkpointing, ("none", "full", "every_k"))
        _positive("parallel.activation_checkpointing_every", self.activation_checkpointing_every)
        if self.dp_replicate is not None:
            _positive("parallel.dp_replicate", self.dp_replicate)
        _choice("parallel.backend", self.backend, ("auto", "nccl", "gloo"))
        _choice("parallel.device", self.device, ("auto", "cuda", "cpu"))
        for key in ("param_dtype", "reduce_dtype"):
            _choice(f"parallel.{key}", getattr(self, key), ("float32", "bfloat16", "float16"))
        if self.output_dtype is not None:
            _choice("parallel.output_dtype", self.output_dtype, ("float32", "bfloat16", "float16"))


@dataclass
class LossConfig:
    impl: str = "chunked"
    """``chunked``: the LM head and the cross-entropy a chunk of label tokens at a time, so the full
    ``[tokens, vocab]`` logits never exist (Liger's fused kernel on CUDA when ``liger-kernel`` is installed,
    torch elsewhere); exact against ``naive`` (the model's logits, then cross-entropy), faster and far smaller
    at large vocabularies. A family whose logits the chunk cannot reproduce runs ``naive`` (logged)."""
    chunk_tokens: int | None = None
    """Label tokens per chunk (``None``: ``2**25 // vocab``, 128 MiB of fp32 logits per chunk)."""

    def validate(self) -> None:
        _choice("loss.impl", self.impl, LOSS_IMPLS)
        if self.chunk_tokens is not None:
            _positive("loss.chunk_tokens", self.chunk_tokens)


@dataclass
class OptimConfig:
    # fused: one kernel over all parameters instead of a loop over tensors; the tiny GPT-2's AdamW step under
    # FSDP2 on one CPU thread went from 41.7 ms to 1.8 ms (a sixth of the whole step). Fused runs on CUDA too.
    optimizer: dict[str, Any] = field(
        default_factory=lambda: {"_target_": "torch.optim.AdamW", "betas": [0.9, 0.95], "eps": 1e-8, "fused": True}
    )
    """The optimizer, built with ``hydra.utils.instantiate(optimizer, params, lr=lr, weight_decay=...)``."""
    lr: float = 3e-4
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Applied to every parameter of 2 or more dimensions: weight matrices and the embedding tables (token
    and position alike, as nanoGPT and torchtitan do); biases and norm weights get none."""
    warmup_steps: int = 10
    """Linear warmup from 0 to ``lr``."""
    min_lr_ratio: float = 0.1
    """Cosine decays to ``lr * min_lr_ratio`` at the last step."""
    grad_clip: float = 1.0
    """Max global gradient norm (``0`` disables clipping)."""

    def validate(self) -> None:
        _positive("optim.lr", self.lr)
        if self.weight_decay < 0 or self.warmup_steps < 0 or self.grad_clip < 0:
            raise ConfigError("optim.weight_decay, optim.warmup_steps and optim.grad_clip must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


PEFT_METHODS = ("none", "lora")
"""``peft.method`` choices: full fine-tuning, or LoRA adapters (``trainer.model.lora``)."""


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning (the ``peft`` group): ``none`` trains every weight; ``lora`` freezes
    the base model and trains low-rank adapters injected by the ``peft`` library (``trainer.model.lora``)."""

    method: str = "none"
    """``none`` (full fine-tuning) or ``lora``."""
    rank: int = 8
    """LoRA rank r of each adapter (A: r x in, B: out x r)."""
    alpha: float = 16.0
    """LoRA scaling numerator: the adapter's update is scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0 keeps training deterministic up to the data order)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names (or name suffixes) that get adapters, e.g. ``[q_proj, v_proj]``; ``[all-linear]``: every
    linear layer of the blocks (the output head excepted), as ``peft`` defines it."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained fully besides the adapters (e.g. ``[lm_head]`` or ``[embed_tokens]``); exported as
    ``peft``'s ``modules_to_save``."""

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def validate(self) -> None:
        _choice("peft.method", self.method, PEFT_METHODS)
        _positive("peft.rank", self.rank)
        _positive("peft.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"peft.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ConfigError("peft.target_modules must name at least one module (or [all-linear])")


@dataclass
class LoggerConfig:
    log_every: int = 1
    """Log metrics every N optimizer steps."""
    wandb: bool = False
    """Also log to Weights & Biases."""
    wandb_project: str = "packfsdp"
    wandb_mode: str = "offline"
    """``offline`` (default: works without network or key), ``online`` or ``disabled``."""
    progress_bar: bool = True
    """Show a progress bar (tqdm: useful tokens/s, loss, ETA) on rank 0 when stderr is a terminal; the
    console log lines and ``metrics.jsonl`` are written either way."""
    peak_tflops: float | None = None
    """Peak dense bf16 TFLOP/s of one device, for the MFU estimate. ``None``: a table of known GPUs, or a
    measured bf16 matmul rate on CPU."""

    def validate(self) -> None:
        _positive("logger.log_every", self.log_every)
        _choice("logger.wandb_mode", self.wandb_mode, ("offline", "online", "disabled"))


@dataclass
class EvalConfig:
    holdout_fraction: float = 0.02
    """Share of examples held out of training for eval (``0`` disables eval). An example is held out iff
    a hash of its tokens (and ``holdout_seed``) falls below this share, so the split is deterministic,
    disjoint from training, the same for packed and padded runs, and duplicates never straddle it."""
    holdout_seed: int = 0
    """Salt of the held-out hash (changing it draws a different held-out set)."""
    every: int = 10
    """Evaluate every N optimizer steps (``0``: only after the last step). Eval always runs at the end."""
    max_examples: int | None = None
    """Evaluate on at most this many held-out examples (the first ones by hash order)."""

    def validate(self) -> None:
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ConfigError(f"eval.holdout_fraction must be in [0, 1), got {self.holdout_fraction}")
        if self.every < 0:
            raise ConfigError(f"eval.every must be >= 0, got {self.every}")
        if self.max_examples is not None:
            _positive("eval.max_examples", self.max_examples)


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Save a checkpoint every N optimizer steps (``0``: by ``every_minutes`` and at the end only)."""
    every_minutes: float = 30.0
    """Also save when this many minutes of wall-clock time (rank 0's clock) passed since the last save or
    the start (``0``: off), so a preempted or crashed run loses at most that much work by default."""
    at_end: bool = True
    """Save a checkpoint when training ends (or stops at ``stop_after_steps``)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted after a newer one is complete (``0``: keep all)."""
    dir: str | None = None
    """Where checkpoints go (``None``: ``<run_dir>/checkpoints``). Must be shared by all nodes."""
    verify: bool = True
    """Check every file against the manifest's SHA-256 before loading (catches flipped or truncated files)."""

    def validate(self) -> None:
        if self.every_steps < 0 or self.keep_last < 0 or self.every_minutes < 0:
            raise ConfigError("checkpoint.every_steps, checkpoint.every_minutes and checkpoint.keep_last must be >= 0")


@dataclass
class GuardConfig:
    """What the trainer does when a step goes wrong (see ``trainer.guard``)."""

    nonfinite: str = "skip"
    """A step whose loss or gradient norm is NaN/Inf on any rank: ``skip`` it on every rank (parameters and
    optimizer state unchanged; counted and logged) or ``stop`` the run with a message naming the step."""
    max_consecutive_skips: int = 5
    """With ``skip``: stop anyway after this many non-finite steps in a row (the run has diverged)."""
    collective_timeout_s: float = 600.0
    """Process-group timeout: a rank that waits this long in a collective (another rank stopped answering)
    fails, so the job exits non-zero and torchrun can restart it. Covers the slowest legitimate wait too
    (rank 0 building the dataset cache while the others wait)."""

    def validate(self) -> None:
        _choice("guard.nonfinite", self.nonfinite, ("skip", "stop"))
        _positive("guard.max_consecutive_skips", self.max_consecutive_skips)
        _positive("guard.collective_timeout_s", self.collective_timeout_s)


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)

    name: str = "run"
    """Run name: the run directory is ``<output_root>/<name>/<timestamp>`` unless ``run_dir`` is set."""
    output_root: str = "outputs"
    run_dir: str | None = None
    """Explicit run directory (all ranks use it as is). Without it, a torchrun restart (same rendezvous id)
    reuses the directory of the attempt it restarts, so ``resume=auto`` finds that attempt's checkpoints."""
    resume: str = "none"
    """``none``; ``auto`` (the latest complete checkpoint of this run under the checkpoint dir, or a fresh
    start when there is none); or the path of a checkpoint (``.../step_00000100``) or of a run / checkpoints
    dir. A new run (``none``) into a run dir that already holds a run is refused."""
    resume_allow_changes: list[str] = field(default_factory=list)
    """Keys (``data.loss_on``, ``grad_accum``, or a section such as ``optim``) whose change from the
    checkpoint's config a resume accepts; any other change that alters the math is refused, naming the keys
    (see ``trainer.checkpoint.config_check``). A flat key, not ``resume.allow_changes``: ``resume=auto``
    must stay a plain value."""
    stop_after_steps: int | None = None
    """Leave the loop after this many steps (checkpointing first) while the schedule still spans
    ``max_steps``/``epochs``: a planned stop, e.g. before a job's time limit, to resume later."""
    seed: int = 1234
    """Seeds model init, data order and dropout."""
    epochs: int = 1
    """Epochs over the data when ``max_steps`` is not set."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (wins over ``epochs``)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank."""
    summary_skip_steps: int = 2
    """Steps excluded from the run summary's throughput averages (warm-up, allocator growth)."""

    def validate(self) -> None:
        for part in (
            self.model, self.data, self.packing, self.parallel, self.optim, self.loss, self.logger, self.eval,
            self.checkpoint, self.guard, self.peft,
        ):
            part.validate()
        _positive("epochs", self.epochs)
        _positive("grad_accum", self.grad_accum)
        if self.max_steps is not None:
            _positive("max_steps", self.max_steps)
        if self.stop_after_steps is not None:
            _positive("stop_after_steps", self.stop_after_steps)
        if self.summary_skip_steps < 0:
            raise ConfigError("summary_skip_steps must be >= 0")
        self.validate_budget()
        self.validate_streaming()

    def validate_streaming(self) -> None:
        """``data.streaming=true`` needs a run length and packs online by best fit, one source at a time."""
        if not self.data.streaming:
            return
        if self.max_steps is None:
            raise ConfigError(
                "data.streaming=true: a stream has no known length, so epochs cannot size the run; set max_steps "
                "(each rank's share of the stream is read again from its start when it runs out)"
            )
        refused = {
            "packing.strategy": (self.packing.strategy != "bfd", f"={self.packing.strategy} (streaming packs "
                                 "online by best fit within data.stream_buffer examples: packing.strategy=bfd)"),
            "data.mix": (bool(self.data.mix), " (mixtures are not streamed yet: stream one source)"),
            "data.limit": (self.data.limit is not None, " (a stream has no head to cut: set max_steps)"),
            "model.tokenizer": (
                self.model.tokenizer_name() == "local_bpe" and self.data.source not in GENERATED_SOURCES,
                "=local_bpe (it trains on the whole data, which a stream never holds; name a pretrained "
                "tokenizer, model.tokenizer=DIR_OR_HUB_ID, or load a model: model=hf model.name_or_path=...)",
            ),
        }
        for key, (bad, why) in refused.items():
            if bad:
                raise ConfigError(f"data.streaming=true cannot be combined with {key}{why}")

    def validate_budget(self, context: int | None = None) -> None:
        """Under a strategy that packs whole examples, one example of the longest allowed length must fit
        one micro-batch; otherwise examples would be cut to the budget behind the user's back.

        Args:
            context: the model's context length when known (``trainer.pipeline`` checks again with it);
                before the model exists, the size set in ``model.random_init``/``config_overrides`` if any.
        """
        if not self.packing.packed or self.packing.splits_examples:
            return
        if context is None:
            context = stated_context(self.model.init_fields())
        longest = self.longest_in_context(context)
        if self.packing.token_budget < longest:
            raise ConfigError(
                f"packing.token_budget={self.packing.token_budget} cannot hold one example of {longest} tokens "
                f"(data.max_length={self.data.max_length}, model context {context or 'unknown'}) and strategy "
                f"{self.packing.strategy} does not split examples; set packing.token_budget>={longest} "
                f"or data.max_length<={self.packing.token_budget}"
            )

    def longest_in_context(self, context: int | None) -> int:
        """``data.max_length`` clamped to the model's ``context`` (when known)."""
        return min(self.data.max_length, context) if context else self.data.max_length

    def max_example_length(self, context: int | None) -> int:
        """The longest example training keeps: ``longest_in_context``, and, unless the strategy splits
        examples, at most one micro-batch's ``packing.token_budget``. So every example fits the model and one
        micro-batch, in packed and padded runs alike."""
        longest = self.longest_in_context(context)
        return longest if self.packing.splits_examples else min(longest, self.packing.token_budget)

    def validate_world(self, world_size: int) -> None:
        """The launch fits the config: checked from ``WORLD_SIZE`` before the process group starts (the one
        check of the mesh shape; ``parallel.build_mesh`` relies on it)."""
        replicas = self.parallel.dp_replicate
        if replicas is not None and world_size % replicas != 0:
            raise ConfigError(
                f"parallel.dp_replicate={replicas} does not divide the world size {world_size}; "
                f"launch a multiple of {replicas} ranks or change parallel.dp_replicate (the number of nodes: "
                "one replica per node)"
            )


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(choices)}")


def _positive(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{key} must be a positive number, got {value!r}")


__all__ = [
    "CODE_OPTIONS",
    "CheckpointConfig",
    "ATTENTION_BACKENDS",
    "CONTEXT_KEYS",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "GuardConfig",
    "JobConfig",
    "LoggerConfig",
    "MISSING",
    "ModelConfig",
    "OptimConfig",
    "PackingConfig",
    "PeftConfig",
    "ParallelConfig",
    "stated_context",
]
