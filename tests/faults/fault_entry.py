"""``python -m tests.faults.fault_entry OVERRIDES``: ``trainer.train`` whose Trainer misbehaves on purpose.

``PFTEST_FAULT="kind@step[:rank],..."`` (``tests.faults.inject``): each rank runs a ``FaultyTrainer`` with its own
faults of the spec. An environment variable of the test, not a config key: it never lands in a saved config.
"""

from __future__ import annotations

import os

from tests.faults.inject import FAULT_ENV, Faults, FaultyTrainer
from tests.quick_exit import run_then_exit
from trainer import loop, train

if __name__ == "__main__":
    FaultyTrainer.faults = Faults(os.environ.get(FAULT_ENV), int(os.environ.get("RANK", "0")))
    loop.Trainer = FaultyTrainer  # trainer.train builds the Trainer it finds in trainer.loop
    run_then_exit(train.main)
