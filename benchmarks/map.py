"""`filter_map` against `jax.lax.map(batch_size=)`, full `vmap` and one map per layer.

The reference workload of penzai#71: 500 x 100 x 100 float32 inputs,
`layer(a) = a @ (a - a.mean())` applied five times, chunks of 20 rows. Prints one table:
wall time and the temporaries `compiled.memory_analysis()` reports, forward and
forward+backward (with and without `remat`), plus each row's ratios to `jax.lax.map`.
Times are the best of `--repeats` interleaved runs.

    python benchmarks/map.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from eqxshard._map import filter_map

N, SIZE, BATCH, LAYERS = 500, 100, 20, 5


def layer(a: jax.Array) -> jax.Array:
    return a @ (a - a.mean())


def all_layers(a: jax.Array) -> jax.Array:
    for _ in range(LAYERS):
        a = layer(a)
    return a


def per_layer(xs: jax.Array) -> jax.Array:
    for _ in range(LAYERS):
        xs = jax.lax.map(layer, xs, batch_size=BATCH)
    return xs


FORWARD: dict[str, Callable[[jax.Array], jax.Array]] = {
    "filter_map": filter_map(all_layers, batch_size=BATCH),
    "jax.lax.map": lambda xs: jax.lax.map(all_layers, xs, batch_size=BATCH),
    "vmap": jax.vmap(all_layers),
    "one map per layer": per_layer,
}
BACKWARD = {
    "filter_map": FORWARD["filter_map"],
    "filter_map(remat=True)": filter_map(all_layers, batch_size=BATCH, remat=True),
    "jax.lax.map": FORWARD["jax.lax.map"],
    "jax.lax.map + checkpoint": lambda xs: jax.lax.map(
        jax.checkpoint(all_layers), xs, batch_size=BATCH
    ),
    "vmap": FORWARD["vmap"],
    "one map per layer": per_layer,
}


def loss_grad(f: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    return jax.grad(lambda xs: jnp.sum(f(xs)))


def measure(cases: dict[str, Callable], xs: jax.Array, repeats: int) -> dict[str, tuple]:
    """Best-of-`repeats` seconds (runs interleaved across cases, so load from other processes
    hits all alike; the minimum is the least noisy estimate on a shared machine) and temps."""
    jitted = {name: jax.jit(f) for name, f in cases.items()}
    temps = {}
    for name, f in jitted.items():
        temps[name] = f.lower(xs).compile().memory_analysis().temp_size_in_bytes
        jax.block_until_ready(f(xs))  # compile + warm up
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, f in jitted.items():
            start = time.perf_counter()
            jax.block_until_ready(f(xs))
            times[name].append(time.perf_counter() - start)
    return {name: (float(np.min(times[name])), temps[name]) for name in cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    repeats = parser.parse_args().repeats
    xs = jax.random.normal(jax.random.key(0), (N, SIZE, SIZE), jnp.float32)
    forward = measure(FORWARD, xs, repeats)
    backward = measure({k: loss_grad(f) for k, f in BACKWARD.items()}, xs, repeats)

    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}, inputs {xs.shape} float32, "
        f"{LAYERS} layers, batch_size={BATCH}, best of {repeats}"
    )
    header = (
        f"{'pass':<9} {'method':<26} {'time ms':>8} {'temp MB':>9} {'t/lax.map':>9} "
        f"{'mem/lax.map':>11}"
    )
    print(header)
    print("-" * len(header))
    for pass_name, results in (("forward", forward), ("fwd+bwd", backward)):
        ref_t, ref_m = results["jax.lax.map"]
        for name, (t, m) in results.items():
            print(
                f"{pass_name:<9} {name:<26} {t * 1e3:8.1f} {m / 1e6:9.2f} {t / ref_t:9.2f} "
                f"{m / ref_m:11.2f}"
            )
    fm_t, fm_m = forward["filter_map"]
    lm_t, lm_m = forward["jax.lax.map"]
    remat_m = backward["filter_map(remat=True)"][1]
    vmap_bwd_m = backward["vmap"][1]
    print()
    print(f"time filter_map / lax.map (forward): {fm_t / lm_t:.3f}   (target <= 1.1)")
    print(f"temps filter_map / lax.map (forward): {fm_m / lm_m:.3f}   (target <= 1.0)")
    print(
        f"time filter_map / one map per layer (forward): "
        f"{fm_t / forward['one map per layer'][0]:.3f}   (target < 1)"
    )
    print(
        f"backward temps vmap / filter_map(remat=True): {vmap_bwd_m / remat_m:.1f}x "
        "  (target >= 10x)"
    )


if __name__ == "__main__":
    main()
