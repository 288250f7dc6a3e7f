"""`filter_map` against `jax.lax.map(batch_size=)`, full `vmap` and one map per layer.

The reference workload of penzai#71: 500 x 100 x 100 float32 inputs,
`layer(a) = a @ (a - a.mean())` applied five times, chunks of 20 rows. Prints one table:
wall time and the temporaries `compiled.memory_analysis()` reports, forward and
forward+backward (with and without `remat`), plus each row's ratios to `jax.lax.map`.
Times are the best of `--repeats` interleaved runs.

A second table times `filter_stream` in its steady state (calls after the first, which
compiles) on 20,000 host rows against a hand-written loop of a jitted `vmap` over the same
chunks, and shows the transfer/compute overlap: the stream's time against the sum of a
transfer-only and a compute-only run over the same chunks.

    python benchmarks/map.py [--repeats 20] [--only map|stream]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from eqxshard import filter_map, filter_stream

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


STREAM_ROWS, STREAM_WIDTH, STREAM_BATCH = 20_000, 128, 2_000


def stream_rows(w: jax.Array, x: jax.Array) -> jax.Array:
    for _ in range(3):
        x = jnp.tanh(x @ w)
    return x


def stream_benchmark(repeats: int) -> None:
    """`filter_stream` steady state vs a hand-written jitted chunk loop, and the overlap."""
    rng = np.random.default_rng(0)
    data = rng.normal(size=(STREAM_ROWS, STREAM_WIDTH)).astype(np.float32)
    w = jnp.asarray(rng.normal(size=(STREAM_WIDTH, STREAM_WIDTH)).astype(np.float32) / 16)
    starts = range(0, STREAM_ROWS, STREAM_BATCH)
    stream = filter_stream(stream_rows, batch_size=STREAM_BATCH, in_axes=(None, 0), progress=False)
    chunk_fn = jax.jit(jax.vmap(stream_rows, in_axes=(None, 0)))

    def hand_loop() -> np.ndarray:
        out = np.empty_like(data)
        for s in starts:
            out[s : s + STREAM_BATCH] = np.asarray(chunk_fn(w, data[s : s + STREAM_BATCH]))
        return out

    resident = [jax.device_put(data[s : s + STREAM_BATCH]) for s in starts]

    def compute_only() -> None:
        for chunk in resident:
            np.asarray(chunk_fn(w, chunk))  # the result's copy back is part of transfer

    def transfer_only() -> None:
        for s in starts:
            np.asarray(jax.device_put(data[s : s + STREAM_BATCH]))  # to device and back

    cases = {
        "filter_stream": lambda: stream(w, data),
        "hand-written jit loop": hand_loop,
        "transfer only": transfer_only,
        "compute only": compute_only,
    }
    np.testing.assert_allclose(stream(w, data), hand_loop(), rtol=1e-5, atol=1e-6)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, f in cases.items():
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    best = {name: float(np.min(t)) for name, t in times.items()}
    print(
        f"filter_stream: {STREAM_ROWS} x {STREAM_WIDTH} float32 host rows, "
        f"batch_size={STREAM_BATCH}, steady state (after the first call), best of {repeats}"
    )
    for name, t in best.items():
        print(f"  {name:<24} {t * 1e3:8.1f} ms")
    serial = best["transfer only"] + best["compute only"]
    print(
        f"time filter_stream / hand-written jit loop: "
        f"{best['filter_stream'] / best['hand-written jit loop']:.3f}   (target <= 1.1)"
    )
    print(
        f"time filter_stream / (transfer only + compute only): "
        f"{best['filter_stream'] / serial:.3f}   (< 1: transfer overlaps compute)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only", choices=("map", "stream"), default=None)
    options = parser.parse_args()
    repeats = options.repeats
    if options.only != "map":
        stream_benchmark(repeats)
        print()
    if options.only == "stream":
        return
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
