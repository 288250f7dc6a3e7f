"""`examples/train_multihost.py` with a SIGKILL of one process injected, for `test_faults.py`:

    python -m eqxshard.launch -n 2 --devices-per-process 2 -- \\
        fault_train.py WHERE STEP PROCESS [train_multihost.py arguments ...]

- `WHERE=step`: process PROCESS is killed at the start of step STEP, before its batch;
- `WHERE=save`: process PROCESS starts the checkpoint save of step STEP in the background
  (`wait=False`) and is killed while it is being written.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import jax
from harness import load_worker

import eqxshard

# Any: the example's names (patched below) are not known before it is loaded.
example: Any = load_worker(
    Path(__file__).resolve().parents[2] / "examples" / "train_multihost.py", "train_multihost"
)
WHERE, STEP, PROCESS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


def sigkill(what: str) -> None:
    print(f"SIGKILL {what}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if WHERE == "step":
    local_batch = example.local_batch

    def killing_local_batch(step: int, batch_size: int) -> Any:
        if step == STEP and jax.process_index() == PROCESS:
            sigkill(f"mid-step {step}")
        return local_batch(step, batch_size)

    example.local_batch = killing_local_batch
else:
    filter_save = eqxshard.filter_save

    def killing_filter_save(directory: Any, step: int, tree: Any, **kwargs: Any) -> Any:
        if step == STEP and jax.process_index() == PROCESS:
            filter_save(directory, step, tree, wait=False)
            sigkill(f"mid-save {step}")
        return filter_save(directory, step, tree, **kwargs)

    eqxshard.filter_save = killing_filter_save

sys.exit(example.main(sys.argv[4:]))
