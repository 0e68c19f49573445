"""packfsdp's errors, a leaf every stage imports (the config too, so it imports no torch): ``ConfigError`` (a
wrong setting), ``LoadError`` (what the config names cannot be loaded; ``trainer.library_log.library_load``
raises it), ``AttentionBackendError`` (the attention backend cannot run here or cannot keep packed examples
apart), ``SelfCheckError`` (a packed batch disagrees with its examples run one by one), and ``first_line``.
"""

from __future__ import annotations

MAX_MESSAGE = 400
"""Characters of the library's message kept in the one line (the log has all of it)."""


class ConfigError(ValueError):
    """A configuration value is wrong. The message says which key and what to change."""


class LoadError(ConfigError):
    """A model, tokenizer or dataset named by the config cannot be loaded; the message is the library's own."""


class AttentionBackendError(RuntimeError):
    """The configured attention backend cannot run here, or cannot keep packed examples apart."""


class SelfCheckError(RuntimeError):
    """The packed (or padded) micro-batch disagrees with its examples run one by one."""


def first_line(exc: BaseException, limit: int | None = MAX_MESSAGE) -> str:
    """The first non-empty line of an exception's message, shortened to ``limit`` characters (``None``: whole);
    its type name when it has none."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."
