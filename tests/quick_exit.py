"""Leave a test's entry point without the interpreter's teardown: with torch, transformers and the trainer
loaded it takes a second or more per rank (seconds on a busy machine), on every launch, and nothing the
tests read depends on it. The ``atexit`` handlers still run (logging's flush, a sweep's process-group
teardown); only the module and object teardown after them is skipped."""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable


def run_then_exit(main: Callable[..., object], *args) -> None:
    """Run ``main(*args)``, then the ``atexit`` handlers, and leave at once with its exit status (``sys.exit``
    codes kept). An exception propagates as usual: its traceback is printed and the interpreter exits normally."""
    try:
        main(*args)
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    atexit._run_exitfuncs()  # what a normal exit runs first
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
