"""The training step's own cost per call: eqxshard against `eqx.filter_jit` and `jax.jit`.

The models are 48 and 500 `eqx.nn.MLP(64, 64, 64, 4)` in a list (480 and 5,000 array
leaves), replicated on every device (8 CPU devices on a CPU-only machine;
`JAX_NUM_CPU_DEVICES=n` for another count), and the step is
`lambda model, x: x * 2 + model[0].layers[0].bias[0]` on a batch `x` of (8 x devices, 8)
split over the devices: its compute is tiny, so what is timed is what each way of calling
it costs around the same dispatch. Each call's output is the next call's `x` (so a
donated `x` is never used twice), and every call is waited on (`block_until_ready`, as
`eqx.filter_jit` and `filter_jit` do themselves to raise `eqx.error_if` errors there).

The ways, each timed in this one run (interleaved: each repeat runs every way in turn, so
drift hits all alike; a sample is as many calls back to back as fill 50 ms, as `timeit`
picks its loop count; medians):

- `jax.jit(f)(leaves, x)`: the step on the model's leaves flattened once before the loop
  (what a hand-written loop over flat leaves pays; the 1.00x every ratio is against);
- `eqx.filter_jit(f)(model, x)`, and with `donate="all-except-first"` (donating `x`);
- `eqxshard.filter_jit(f)(model, x)`; with `in_shardings=(None, P("data"))`; with every
  layout given (`in_shardings=(replicated, P("data"))`, `out_shardings=P("data")`) and
  `donate=(False, True)`; and with `donate="all-except-first"`;
- `StepLoop(eqxshard.filter_jit(f), model, carry=0)(x)`: the model held flat between
  calls (an evaluation loop: nothing carried; a training step carries its model and
  optimiser state the same way, and hands their leaves back as any step does).

    python benchmarks/step.py [--quick] [--repeats 15]

Each target gets a PASS/MISS; the timings are not checked by the test suite (it only runs
`--quick` to keep this script working).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

# 8 CPU devices (JAX_NUM_CPU_DEVICES=n for another count), before JAX starts its
# backends. GPUs and TPUs are not affected: the benchmark uses every device it finds.
if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _table import print_table  # noqa: E402  (benchmarks/_table.py)
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import eqxshard  # noqa: E402

MIN_SAMPLE_S = 0.05
EQX_TARGET = 1.0  # filter_jit per call, against eqx.filter_jit
LOOP_TARGET = 1.3  # StepLoop per call, against jax.jit on flat leaves (480 leaves)


def make_model(n_mlps: int) -> list[eqx.nn.MLP]:
    mlp = eqx.nn.MLP(64, 64, 64, 4, key=jax.random.key(0))
    rng = np.random.default_rng(0)

    def draw(x: Any) -> Any:
        return (rng.normal(size=x.shape) / 8).astype(x.dtype) if eqx.is_array(x) else x

    return [jax.tree.map(draw, mlp) for _ in range(n_mlps)]


def step(model: Any, x: Any) -> Any:
    return x * 2 + model[0].layers[0].bias[0]


def _timed(call: Callable[[], Any], calls: int) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(call())
        return (time.perf_counter() - start) / calls
    finally:
        gc.enable()


def interleaved(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """The median seconds per call of each way; each repeat runs every way in turn."""
    loops = {}
    for name, call in calls.items():
        call()  # compiled and warm
        once = _timed(call, 1)
        loops[name] = max(1, min(200, math.ceil(MIN_SAMPLE_S / max(once, 1e-9))))
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(_timed(calls[name], loops[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


class Fed:
    """A way of calling the step whose output is its next `x`."""

    def __init__(self, call: Callable[[Any], Any], x: Any):
        self.call, self.x = call, x

    def __call__(self) -> Any:
        self.x = self.call(self.x)
        return self.x


def ways(n_mlps: int) -> dict[str, Callable[[], Any]]:
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    replicated = NamedSharding(mesh, P())
    model = eqxshard.filter_shard(make_model(n_mlps), mesh)
    leaves = [x for x in jax.tree.leaves(model) if eqx.is_array(x)]
    rows = NamedSharding(mesh, P("data"))

    def x0() -> Any:
        return jax.device_put(jnp.ones((8 * n, 8), jnp.float32), rows)

    raw = jax.jit(lambda leaves, x: x * 2 + leaves[1][0])  # leaves[1]: layers[0].bias
    eqx_plain = eqx.filter_jit(step)
    eqx_donate = eqx.filter_jit(step, donate="all-except-first")
    ours = eqxshard.filter_jit(step)
    ours_in = eqxshard.filter_jit(step, in_shardings=(None, P("data")), mesh=mesh)
    ours_all = eqxshard.filter_jit(
        step,
        in_shardings=(replicated, P("data")),
        out_shardings=P("data"),
        donate=(False, True),
        mesh=mesh,
    )
    ours_donate = eqxshard.filter_jit(step, donate="all-except-first")
    loop = eqxshard.StepLoop(ours, model, carry=0)
    return {
        "jax.jit on flat leaves": Fed(lambda x: raw(leaves, x), x0()),
        "eqx.filter_jit": Fed(lambda x: eqx_plain(model, x), x0()),
        "eqx.filter_jit, donate x": Fed(lambda x: eqx_donate(model, x), x0()),
        "eqxshard.filter_jit": Fed(lambda x: ours(model, x), x0()),
        "filter_jit, in_shardings": Fed(lambda x: ours_in(model, x), x0()),
        "filter_jit, in+out_shardings, donate": Fed(lambda x: ours_all(model, x), x0()),
        "filter_jit, donate x": Fed(lambda x: ours_donate(model, x), x0()),
        "StepLoop, model held flat": Fed(loop, x0()),
    }


def table(n_mlps: int, repeats: int) -> list[tuple[str, ...]]:
    times = interleaved(ways(n_mlps), repeats)
    raw, eqx_time = times["jax.jit on flat leaves"], times["eqx.filter_jit"]
    out = []
    for name, t in times.items():
        vs_eqx = "" if name.startswith("jax.jit") else f"{t / eqx_time:.2f}x"
        target, result = "", ""
        if name.startswith(("eqxshard", "filter_jit")):
            anchor = eqx_time if "donate x" not in name else times["eqx.filter_jit, donate x"]
            target = f"<= {EQX_TARGET:.1f}x eqx"
            result = "PASS" if t / anchor <= EQX_TARGET else "MISS"
            vs_eqx = f"{t / anchor:.2f}x"
        elif name.startswith("StepLoop") and n_mlps * 10 <= 480:
            target = f"<= {LOOP_TARGET:.1f}x jit"
            result = "PASS" if t / raw <= LOOP_TARGET else "MISS"
        out.append((name, f"{t * 1e6:.0f} us", f"{t / raw:.2f}x", vs_eqx, target, result))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (2 repeats, 480 only)")
    parser.add_argument("--repeats", type=int, default=15, help="repeats per way")
    args = parser.parse_args()
    sizes = (48,) if args.quick else (48, 500)
    print(
        f"eqxshard {eqxshard.__version__} step benchmark: jax {jax.__version__}, equinox "
        f"{eqx.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the start."
    )
    for n_mlps in sizes:
        repeats = 2 if args.quick else args.repeats
        print()
        print(
            f"{n_mlps} x eqx.nn.MLP(64, 64, 64, 4) = {n_mlps * 10} array leaves; medians of "
            f"{repeats} interleaved samples (vs eqx: the donating rows against "
            "eqx.filter_jit donating x):"
        )
        header = ("way", "per call", "vs jax.jit", "vs eqx", "target", "result")
        print_table([header, *table(n_mlps, repeats)], right={1, 2, 3})
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end.")


if __name__ == "__main__":
    main()
