"""The words of the libraries we load through, brought to the user (``library_load``).

packfsdp keeps transformers' and datasets' logging at ERROR (their chatter would drown the run's log), so
what they say while loading what the config names would be lost: "weights newly initialised", a config
field ignored, a file that cannot be parsed. ``library_load`` wraps such a load: the libraries' warnings are
relayed to our log (rank 0, once each) and a failure becomes one ``LoadError`` line naming what was loaded
and the library's own message, with the full traceback in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from trainer import distributed
from trainer.errors import ConfigError, LoadError, first_line

log = logging.getLogger(__name__)

LIBRARY_LOGGERS = ("transformers", "datasets")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().strip()
        if message and message not in self.messages:
            self.messages.append(message)


@contextmanager
def library_load(what: str) -> Iterator[None]:
    """Load ``what`` (e.g. ``model.name_or_path=/models/x``) with the libraries' warnings relayed to our
    log and any failure raised as a one-line ``LoadError`` (our own ``ConfigError`` passes unchanged)."""
    collect = _Collect()
    saved = []
    for name in LIBRARY_LOGGERS:
        lib = logging.getLogger(name)
        saved.append((lib, lib.level, lib.handlers[:]))
        lib.handlers = [collect]  # their own stderr handler would print unformatted, on every rank
        lib.setLevel(logging.WARNING)
    try:
        yield
    except ConfigError:
        raise
    except Exception as e:
        log.error("loading %s failed; what the library said:\n%s", what, "\n".join(collect.messages) or "-", exc_info=e)
        raise LoadError(f"cannot load {what}: {type(e).__name__}: {first_line(e)}") from e
    finally:
        for lib, level, handlers in saved:
            lib.handlers = handlers
            lib.setLevel(level)
    if distributed.rank() == 0:
        for message in collect.messages:
            log.warning("%s says: %s", what, message)
