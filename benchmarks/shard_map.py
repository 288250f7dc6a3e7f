"""`jit(filter_shard_map(step))` against `jit(pmap(step))` and `pmap(step)`, multi-step loop.

The workload is the shape of the pmap cookbook's collectives section: each device (8 CPU
devices on a CPU-only machine, `JAX_NUM_CPU_DEVICES=n` for another count; every
accelerator it finds otherwise) holds a block of a 1-D field; one step exchanges a halo
cell with each neighbour (`ppermute` on a ring), takes a diffusion step, and renormalises with a
`psum`. The loop runs 100 steps (20 with `--quick`), either inside one `jit`
(`fori_loop`) or as one call per step from Python, each waited for. Every row runs in the
same process, interleaved, and is reported as a ratio to `pmap(step)` called from Python
(the classic way). The last column says how the result is laid out: `jit(pmap)` on
jax < 0.8 gathers it, a full copy on every device (jax#2926); the others keep each
device's block where it is.

    python benchmarks/shard_map.py [--quick] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from collections.abc import Callable

import jax

# 8 CPU devices (JAX_NUM_CPU_DEVICES=n for another count), before JAX starts its
# backends. GPUs and TPUs are not affected: the benchmark uses every device it finds.
if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from eqxshard import filter_shard_map  # noqa: E402

N_DEV = jax.device_count()


def step(x: jax.Array) -> jax.Array:
    """One step on this device's block (last axis): halo exchange, diffusion, renormalise."""
    ring = [(j, (j + 1) % N_DEV) for j in range(N_DEV)]
    back = [((j + 1) % N_DEV, j) for j in range(N_DEV)]
    left = jax.lax.ppermute(x[..., -1:], "i", ring)  # the left neighbour's last cell
    right = jax.lax.ppermute(x[..., :1], "i", back)  # the right neighbour's first cell
    wide = jnp.concatenate([left, x, right], axis=-1)
    x = x + 0.2 * (wide[..., :-2] - 2 * x + wide[..., 2:])
    return x / jax.lax.psum(jnp.sum(x), "i")


def loop_in_jit(one_step: Callable, steps: int) -> Callable:
    return jax.jit(lambda x: jax.lax.fori_loop(0, steps, lambda _, x: one_step(x), x))


def loop_in_python(one_step: Callable, steps: int) -> Callable:
    def run(x):
        for _ in range(steps):
            # Waited for each step: XLA's in-process CPU collectives can deadlock with many
            # collective programs in flight on few cores (seen here with 100 queued steps).
            x = jax.block_until_ready(one_step(x))
        return x

    return run


def layout(x: jax.Array) -> str:
    """ "sharded" (each device holds its block) or "replicated" (gathered: all on each)."""
    n = len(x.sharding.device_set)
    kind = "replicated" if x.sharding.is_fully_replicated else "sharded"
    return f"{kind} on {n}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    steps = 20 if args.quick else 100
    repeats = args.repeats or (5 if args.quick else 20)
    size = 4096  # cells per device

    mesh = jax.make_mesh((N_DEV,), ("i",), axis_types=(AxisType.Auto,))
    sm_step = filter_shard_map(step, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    pmap_step = jax.pmap(step, axis_name="i")

    field = np.exp(-(np.linspace(-4.0, 4.0, N_DEV * size) ** 2)).astype(np.float32)
    x_sm = jax.device_put(field, NamedSharding(mesh, P("i")))  # (8 * size,) on the mesh
    x_pmap = jax.pmap(lambda x: x)(field.reshape(N_DEV, size))  # (8, size), one row each

    cases: dict[str, tuple[Callable, jax.Array]] = {
        "jit(filter_shard_map), loop in jit": (loop_in_jit(sm_step, steps), x_sm),
        "jit(filter_shard_map), loop in Python": (
            loop_in_python(jax.jit(sm_step), steps),
            x_sm,
        ),
        "jit(pmap), loop in jit": (loop_in_jit(pmap_step, steps), x_pmap),
        "pmap, loop in Python": (loop_in_python(pmap_step, steps), x_pmap),
    }
    anchor = "pmap, loop in Python"

    with warnings.catch_warnings():
        # jax < 0.8 warns about jit-of-pmap (jax#2926); measuring that cost is the point.
        warnings.filterwarnings("ignore", message=".*includes a pmap", category=UserWarning)
        results = {name: f(x) for name, (f, x) in cases.items()}  # compile + warm up
        jax.block_until_ready(results)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(repeats):
            for name, (f, x) in cases.items():
                start = time.perf_counter()
                jax.block_until_ready(f(x))
                times[name].append(time.perf_counter() - start)

    reference = np.asarray(results[anchor]).reshape(-1)
    for out in results.values():
        np.testing.assert_allclose(np.asarray(out).reshape(-1), reference, rtol=2e-4, atol=1e-9)

    median = {name: float(np.median(t)) for name, t in times.items()}
    print(
        f"jax {jax.__version__}, {N_DEV} x {jax.devices()[0].device_kind}, field "
        f"{N_DEV} x {size} float32, {steps} steps, median of {repeats} (interleaved)"
    )
    header = f"{'method':<40} {'time ms':>9} {'ms/step':>8} {'t/pmap':>7}  {'result'}"
    print(header)
    print("-" * len(header))
    for name, t in median.items():
        print(
            f"{name:<40} {t * 1e3:9.2f} {t * 1e3 / steps:8.3f} {t / median[anchor]:7.2f}  "
            f"{layout(results[name])}"
        )
    best = median["jit(filter_shard_map), loop in jit"]
    print()
    print(f"jit(filter_shard_map) loop / pmap loop:      {best / median[anchor]:.3f}  (target < 1)")
    print(
        f"jit(filter_shard_map) loop / jit(pmap) loop: "
        f"{best / median['jit(pmap), loop in jit']:.3f}  (target <= 1)"
    )


if __name__ == "__main__":
    main()
