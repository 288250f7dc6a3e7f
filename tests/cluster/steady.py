"""A run that keeps every process busy in collectives until it is broken, for the fault
tests: `steady.py CHECKPOINT_DIR [SECONDS]`.

Joins with `eqxshard.initialize()` (the timeouts come from the launcher's variables),
then each step sums a sharded array over every device (a gloo collective across the
nodes), saves a checkpoint every 5 steps, logs `step N`, and sleeps 0.2 s; after SECONDS
(default 120) it ends with code 3, so that a run the fault did not break still ends.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import eqxshard

eqxshard.initialize()
directory, seconds = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 120.0
mesh = jax.make_mesh((jax.device_count(),), ("data",))
x = eqxshard.filter_shard(np.arange(jax.device_count(), dtype=np.float32), mesh, P("data"))
total = jax.jit(jnp.sum)
end = time.monotonic() + seconds
step = 0
while time.monotonic() < end:
    step += 1
    value = float(total(x + step))
    if step % 5 == 0:
        eqxshard.filter_save(directory, step, {"x": x + step})
    print(f"step {step} sum {value:g}", flush=True)
    time.sleep(0.2)
print("not broken: ending", flush=True)
sys.exit(3)
