"""Evaluate an Equinox model on a grid too large to `vmap` at once.

A 512 x 512 grid of inputs through an MLP: one `vmap` over all 262,144 points needs
hundreds of MB of temporaries, more than the (pretend) device budget: an eighth of what
that `vmap` needs, as measured on this device. This script

1. measures the temporaries of `vmap` and of `eqxshard.filter_map` with
   `compiled.memory_analysis()` and picks the largest `batch_size` that fits the budget;
2. evaluates the grid with `filter_map`, on one device and sharded over every device
   (each works through its own rows, chunk by chunk, with no communication);
3. streams a grid kept in host memory with `eqxshard.filter_stream`, the way one would
   evaluate data that does not fit on the devices at all.

    python examples/grid_eval.py
"""

import os
import time

import jax

# 8 simulated devices on CPU (JAX_NUM_CPU_DEVICES=n for another count), before JAX
# starts. GPUs and TPUs are not affected: the script uses every device it finds.
if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import eqxshard  # noqa: E402

BUDGET_FRACTION = 8  # pretend the device has room for 1/8 of the temporaries of one vmap
SIDE = 512


def evaluate(model: eqx.nn.MLP, point: jax.Array) -> jax.Array:
    return model(point)[0]


def temp_mb(fun, model: eqx.nn.MLP, points: jax.Array) -> float:
    """Temporaries of `fun(model, points)` once compiled, by `memory_analysis()`."""
    jitted = eqxshard.filter_jit(fun)
    compiled = jitted.lower(model, points).compile()  # pyright: ignore[reportFunctionMemberAccess]
    return compiled.memory_analysis().temp_size_in_bytes / 1e6


def matmul_rtol() -> float:
    """A tolerance for float32 results here: 1e-5, or more where the platform's default
    matmul precision is lower (TF32 on recent NVIDIA GPUs), from one measured product."""
    a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    default = np.asarray(jnp.dot(a, a))
    with jax.default_matmul_precision("highest"):
        exact = np.asarray(jnp.dot(a, a))
    return max(1e-5, 10 * float(np.max(np.abs(default - exact)) / np.max(np.abs(exact))))


def main() -> None:
    model = eqx.nn.MLP(2, 1, width_size=128, depth=2, activation=jax.nn.gelu, key=jax.random.key(0))
    axis = jnp.linspace(-3.0, 3.0, SIDE)
    points = jnp.stack(jnp.meshgrid(axis, axis, indexing="ij"), axis=-1).reshape(-1, 2)

    # 1. How much would one vmap need (on this device), and which batch size fits?
    full = eqx.filter_vmap(evaluate, in_axes=(None, 0))
    full_mb = temp_mb(full, model, points)
    budget_mb = full_mb / BUDGET_FRACTION
    print(f"grid: {SIDE} x {SIDE} = {len(points):,} points, budget {budget_mb:.1f} MB")
    print(f"  vmap over all points at once: {full_mb:8.1f} MB of temporaries")
    batch_size = len(points)
    while True:
        batch_size //= 4
        chunked = eqxshard.filter_map(evaluate, batch_size=batch_size, in_axes=(None, 0))
        mb = temp_mb(chunked, model, points)
        print(f"  filter_map(batch_size={batch_size:>6}):      {mb:8.1f} MB of temporaries")
        if mb <= budget_mb:
            break

    # 2. Evaluate with the chunk size that fits, on one device and then on all of them.
    run = eqxshard.filter_jit(chunked)
    values = run(model, points).block_until_ready()
    start = time.perf_counter()
    values = run(model, points).block_until_ready()
    print(f"one device: {time.perf_counter() - start:.2f} s")

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("points",), axis_types=(AxisType.Explicit,))
    sharded_points = jax.device_put(points, NamedSharding(mesh, P("points")))
    replicated_model = eqxshard.filter_replicate(model, mesh)
    run_sharded = eqxshard.filter_jit(chunked)
    sharded_values = run_sharded(replicated_model, sharded_points).block_until_ready()
    start = time.perf_counter()
    sharded_values = run_sharded(replicated_model, sharded_points).block_until_ready()
    assert isinstance(sharded_values.sharding, NamedSharding)
    print(
        f"{n} devices: {time.perf_counter() - start:.2f} s, output sharding "
        f"{sharded_values.sharding.spec}"
    )

    # 3. The same grid from host memory, in chunks, onto all the devices.
    host_points = np.asarray(points)
    stream = eqxshard.filter_stream(evaluate, batch_size=n * 4096, in_axes=(None, 0), mesh=mesh)
    streamed = stream(replicated_model, host_points)

    # The three agree, and match a plain vmap on a slice small enough to fit.
    # (Chunks of different sizes may round differently: the tolerance follows the platform's
    # matmul precision.)
    check = full(model, points[:4096])
    rtol = matmul_rtol()
    np.testing.assert_allclose(values[:4096], check, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(sharded_values, values, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(streamed, values, rtol=rtol, atol=rtol)
    image = np.asarray(values).reshape(SIDE, SIDE)
    print(
        f"model output over the grid: min {image.min():.3f}, max {image.max():.3f}, "
        f"mean {image.mean():.3f}"
    )


if __name__ == "__main__":
    main()
