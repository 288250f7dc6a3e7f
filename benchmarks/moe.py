"""`eqxshard.moe`'s dispatch against the dense layer and the all-gather one, on 8 CPU
devices.

One forward and backward (`jax.grad` of `sum(y**2)` with respect to the experts, the
tokens and the combine weights, under `jit`) of a mixture-of-experts layer: `E` experts,
each an MLP `D -> hidden -> D`, on `N` tokens `(N, D)`, top-`k` of a softmax router (the
router's choices are inputs here). The cases:

- `dense, 1 device`: every expert on every token on one device, each token then keeping
  its `k` outputs (`E/k` times the work a token needs);
- `all_gather experts`: tokens and experts split over the 8 devices; each device gathers
  every expert (`all_gather`, a `reduce_scatter` back) and runs all `E` on its tokens;
- `moe, dropless`, `moe, capacity c`: `eqxshard.moe` over an expert axis of 8 devices
  (tokens split over it too), dropless and with GShard capacity factors 1.0, 1.25, 2.0.

For each: the time (median of `--repeats`, interleaved) as a ratio to the dense layer's
and to the dropless dispatch's; the expert rows each device computes (what its experts
run on: the `k/E` share shows as capacity's `c * n_local * k` against the dense layer's
`E * N`); how many assignments the capacity dropped; bytes per device from
`memory_analysis()` (arguments + outputs + temporaries); and the collectives of the
compiled HLO, counted by kind (`a2a` all-to-all, `ag` all-gather, `rs` reduce-scatter,
`ar` all-reduce).

On CPU devices that share two cores, every "device" competes for the same cores: the
times say how much work each case does, not what an interconnect would add; the bytes and
rows carry over.

    python benchmarks/moe.py [--quick] [--repeats 3] [--tokens N] [--no-time] [--out FILE]

`--quick`: N = 1024, one repeat (under a minute on a loaded 2-core machine).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from _compiled import collectives, mib, per_device  # noqa: E402
from _table import print_table, recorded  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import eqxshard  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def expert(block, h):
    """One expert, an MLP, on a batch of tokens `h` `(m, D)`."""
    return jax.nn.relu(h @ block["w1"]) @ block["w2"]


def dense(experts, x, indices, weights):
    """Every expert on every token, each token keeping its `k` outputs."""
    every = jax.vmap(lambda block: expert(block, x))(experts)  # (E, N, D)
    picked = every[indices, jnp.arange(x.shape[0])[:, None]]  # (N, k, D)
    return jnp.sum(weights[..., None] * picked, axis=1)


def gathered(mesh):
    """Each device gathers every expert and runs them all on its own tokens."""

    def body(experts, x, indices, weights):
        every = jax.tree.map(lambda a: jax.lax.all_gather(a, "expert", tiled=True), experts)
        return dense(every, x, indices, weights)

    split = P("expert")
    return jax.shard_map(
        body, mesh=mesh, in_specs=({"w1": split, "w2": split}, split, split, split), out_specs=split
    )


def _grad(layer):
    def loss(experts, x, weights, indices):
        return jnp.sum(layer(experts, x, indices, weights) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def run(n: int, e: int, d: int, hidden: int, k: int, repeats: int, timed: bool) -> list[tuple]:
    """The rows for one token count."""
    devices = jax.devices()
    a = len(devices)
    mesh = jax.make_mesh((a,), ("expert",), axis_types=(AxisType.Auto,))
    split = NamedSharding(mesh, P("expert"))
    one = jax.sharding.SingleDeviceSharding(devices[0])
    keys = jax.random.split(jax.random.key(0), 4)
    experts = {
        "w1": jax.random.normal(keys[0], (e, d, hidden)) / d**0.5,
        "w2": jax.random.normal(keys[1], (e, hidden, d)) / hidden**0.5,
    }
    x = jax.random.normal(keys[2], (n, d))
    router = jax.random.normal(keys[3], (d, e))
    weights, indices = jax.lax.top_k(jax.nn.softmax(x @ router), k)
    local = n // a
    cases: dict[str, tuple[Callable[..., Any], Any, int, float | None]] = {
        "dense, 1 device": (dense, one, e * n, None)
    }
    cases["all_gather experts"] = (gathered(mesh), split, e * local, None)
    for factor in (None, 1.0, 1.25, 2.0):

        def layer(experts, x, indices, weights, factor=factor):
            return eqxshard.moe(
                expert, experts, x, indices, weights, mesh=mesh, capacity_factor=factor
            )

        if factor is None:
            name, rows = "moe, dropless", e * local * k
        else:
            name, rows = f"moe, capacity {factor}", e * math.ceil(factor * local * k / e)
        cases[name] = (layer, split, rows, factor)
    inputs, compiled = {}, {}
    for name, (layer, where, _, _) in cases.items():
        inputs[name] = jax.device_put((experts, x, weights, indices), where)
        compiled[name] = _grad(layer).lower(*inputs[name]).compile()
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    if timed:
        for name in cases:  # warm up
            jax.block_until_ready(compiled[name](*inputs[name]))
        for _ in range(repeats):
            for name in cases:
                start = time.perf_counter()
                jax.block_until_ready(compiled[name](*inputs[name]))
                seconds[name].append(time.perf_counter() - start)
    median = {name: statistics.median(s) if s else None for name, s in seconds.items()}
    base, dropless = median["dense, 1 device"], median["moe, dropless"]
    rows = []
    for name, (_, _, work, factor) in cases.items():
        m = median[name]
        dropped = "-"
        if factor is not None:
            _, count = eqxshard.moe(
                expert,
                inputs[name][0],
                inputs[name][1],
                inputs[name][3],
                inputs[name][2],
                mesh=mesh,
                capacity_factor=factor,
                return_dropped=True,
            )
            dropped = f"{int(count) / (n * k):.1%}"
        rows.append(
            (
                str(n),
                name,
                f"{m * 1e3:,.0f} ms" if m else "-",
                f"{m / base:.2f}x" if m and base else "-",
                f"{m / dropless:.2f}x" if m and dropless else "-",
                f"{work:,}",
                dropped,
                mib(per_device(compiled[name])),
                collectives(compiled[name].as_text() or ""),
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="1024 tokens, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, nargs="+", help="default 4096")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--top", type=int, default=2, help="k, the experts per token")
    parser.add_argument("--no-time", action="store_true", help="compile only: bytes, HLO")
    parser.add_argument("--out", type=Path, help="the results file (default: results/)")
    args = parser.parse_args()
    tokens, repeats = ([1024], 1) if args.quick else ([4096], args.repeats)
    tokens = args.tokens or tokens
    default = RESULTS / f"moe_cpu{'_quick' if args.quick else ''}.txt"
    with recorded(args.out or default):
        print(
            f"jax {jax.__version__}, {jax.device_count()} x {jax.default_backend()}; "
            f"E={args.experts} experts (MLP {args.dim} -> {args.hidden} -> {args.dim}), "
            f"top-{args.top}, float32, forward + backward; expert axis of "
            f"{jax.device_count()}; "
            + ("compiled only" if args.no_time else f"medians of {repeats}")
        )
        rows = [
            (
                "N",
                "case",
                "time",
                "/dense",
                "/dropless",
                "expert rows/device",
                "dropped",
                "bytes/device",
                "collectives",
            )
        ]
        for n in tokens:
            rows += run(n, args.experts, args.dim, args.hidden, args.top, repeats, not args.no_time)
        print_table(rows, right={0, 2, 3, 4, 5, 6, 7})


if __name__ == "__main__":
    main()
