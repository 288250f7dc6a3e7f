"""One process of a 2-process run that fails on purpose: `python -m eqxshard.launch -n 2
--devices-per-process 2 -- fault_worker.py FAULT DIRECTORY`, for `test_faults.py`.

Both processes train a tiny model with a collective every step and save a checkpoint
every step into DIRECTORY; at step `FAULT_STEP` process `FAULT_PROCESS` fails as FAULT
says (both processes get the same arguments, as under a real launcher):

- `exception`: raises `RuntimeError`;
- `exit`: `sys.exit(3)`;
- `hang`: sleeps (until the launcher's `--timeout`);
- `mismatch`: passes a tree of another structure to `filter_shard` than the other process;
- `disk_full`: its checkpoint writes fail as on a full disk (the file size limit
  `RLIMIT_FSIZE`, which holds for root too, set to 0: writes fail with `EFBIG`);
- `none`: no fault.

Each process prints `step N` after each step and `saved N` after each save.
"""

from __future__ import annotations

import resource
import signal
import sys
import time

import eqxshard

eqxshard.initialize(heartbeat_timeout_seconds=10)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

FAULT, DIRECTORY = sys.argv[1], sys.argv[2]
FAULT_PROCESS = int(sys.argv[3]) if len(sys.argv) > 3 else 1
FAULT_STEP, STEPS = 2, 4


def main() -> None:
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    params = eqxshard.filter_shard({"w": jnp.arange(8.0), "b": jnp.ones(4)}, mesh, P("data"))
    step_fn = jax.jit(lambda p: jax.tree.map(lambda a: a * 0.5 + a.sum() / 100, p))
    faulty = jax.process_index() == FAULT_PROCESS
    for step in range(1, STEPS + 1):
        if step == FAULT_STEP and faulty:
            if FAULT == "exception":
                raise RuntimeError(f"injected failure at step {step}")
            if FAULT == "exit":
                sys.exit(3)
            if FAULT == "hang":
                time.sleep(3600)
            if FAULT == "disk_full":
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the signal kills it
                resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
        batch = {"x": jnp.ones(8), "y": jnp.ones(4)}
        if step == FAULT_STEP and faulty and FAULT == "mismatch":
            batch = {"x": jnp.ones(8)}  # the other process passes "y" too
        eqxshard.filter_shard(batch, mesh, P("data"))
        params = step_fn(params)
        jax.block_until_ready(params)
        print(f"step {step}", flush=True)
        eqxshard.filter_save(DIRECTORY, step, params)
        print(f"saved {step}", flush=True)


main()
