"""A short run for the tests of runs that go on with fewer hosts:
`fragile.py DIR STEPS [--die R:P:S ...] [--fail-start R:P ...]`.

Joins with `eqxshard.initialize()` (the launcher's variables), resumes from the newest
checkpoint in DIR, and each step sums a sharded array over every device (a gloo
collective across the nodes), saves a checkpoint every 3 steps, and logs `step N of K
processes`. Faults, by the launcher's attempt R (`EQXSHARD_RESTART_COUNT`):
`--die R:P:S` ends process P at step S with `os._exit(1)` (a crash);
`--fail-start R:P` ends process P with code 2 before it joins the run.
"""

import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("directory")
parser.add_argument("steps", type=int)
parser.add_argument("--die", action="append", default=[])
parser.add_argument("--fail-start", action="append", default=[])
args = parser.parse_args()
attempt = int(os.environ["EQXSHARD_RESTART_COUNT"])
me = int(os.environ["EQXSHARD_PROCESS_ID"])
if f"{attempt}:{me}" in args.fail_start:
    print(f"process {me} fails at start-up", flush=True)
    raise SystemExit(2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import eqxshard  # noqa: E402

eqxshard.initialize()
mesh = jax.make_mesh((jax.device_count(),), ("data",))
x = eqxshard.filter_shard(np.arange(jax.device_count(), dtype=np.float32), mesh, P("data"))
total = jax.jit(jnp.sum)
start = eqxshard.latest_step(args.directory) or 0
print(f"starting after step {start} with {jax.process_count()} processes", flush=True)
for step in range(start + 1, args.steps + 1):
    if f"{attempt}:{me}:{step}" in args.die:
        print(f"process {me} dies at step {step}", flush=True)
        os._exit(1)
    value = float(total(x + step))
    if step % 3 == 0:
        eqxshard.filter_save(args.directory, step, {"x": x + step})
    print(f"step {step} of {jax.process_count()} processes, sum {value:g}", flush=True)
