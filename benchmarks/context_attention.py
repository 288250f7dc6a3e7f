"""`eqxshard.context_attention`'s strategies against unsplit attention, on 8 CPU devices.

One forward and backward (`jax.grad` of `sum(out**2)` with respect to query, key and value,
under `jit`) of attention over `(1, T, H, D)` inputs, the sequence split over a context
axis of 8 devices:

- `unsplit`: plain attention on one device (softmax in float32), where its `T x T` scores
  fit `--fit` bytes (by its compile's `memory_analysis()`; it is then run too);
- `ring`, `all_gather`, `all_to_all`: `context_attention(strategy=...)`; the ring also
  with `causal=True` (zig-zag balanced, the masked half of each block skipped).

For each: the time (median of `--repeats`, interleaved) as a ratio to the ring's
(non-causal) and to `unsplit` where it ran; bytes per device from `memory_analysis()`
(arguments + outputs + temporaries); and the collectives of the compiled HLO, counted by
kind (`cp` collective-permute, `ag` all-gather, `a2a` all-to-all, `ar` all-reduce; a
ring's permutes sit in a loop, so each is counted once, not once per step).

On CPU devices that share two cores, every "device" competes for the same cores: the
times say how much work each strategy does (and the causal ring's saving, expected at
most about 0.6x), not what an interconnect would add; the bytes carry over.

    python benchmarks/context_attention.py [--quick] [--repeats 3] [--lengths T ...]
        [--no-time] [--out FILE]

`--quick`: T = 1024 and 4096, one repeat (about 2 minutes on a loaded 2-core machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import jax

if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from _compiled import collectives, mib, per_device  # noqa: E402
from _table import print_table, recorded  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import eqxshard  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def unsplit(q, k, v, causal):
    t = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / q.shape[-1] ** 0.5
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def _grad(attention):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v) ** 2), argnums=(0, 1, 2)))


def run(t: int, heads: int, dim: int, repeats: int, fit: int, timed: bool) -> list[tuple]:
    """The rows for one sequence length."""
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("context",), axis_types=(AxisType.Auto,))
    split = NamedSharding(mesh, P(None, "context"))
    keys = jax.random.split(jax.random.key(0), 3)
    shape = jax.ShapeDtypeStruct((1, t, heads, dim), jnp.float32)
    cases = {}
    one = jax.sharding.SingleDeviceSharding(devices[0])
    plain = _grad(lambda q, k, v: unsplit(q, k, v, False)).lower(shape, shape, shape).compile()
    if per_device(plain) <= fit:
        cases["unsplit"] = (plain, one)
    for strategy, causal in (
        ("ring", False),
        ("ring", True),
        ("all_gather", False),
        ("all_to_all", False),
    ):

        def attention(q, k, v, strategy=strategy, causal=causal):
            return eqxshard.context_attention(q, k, v, causal=causal, mesh=mesh, strategy=strategy)

        sharded = jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=split)
        compiled = _grad(attention).lower(sharded, sharded, sharded).compile()
        cases[f"{strategy}{', causal' if causal else ''}"] = (compiled, split)
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    if timed:
        inputs = {
            name: [jax.device_put(jax.random.normal(k, shape.shape), where) for k in keys]
            for name, (_, where) in cases.items()
        }
        for name, (compiled, _) in cases.items():  # warm up
            jax.block_until_ready(compiled(*inputs[name]))
        for _ in range(repeats):
            for name, (compiled, _) in cases.items():
                start = time.perf_counter()
                jax.block_until_ready(compiled(*inputs[name]))
                seconds[name].append(time.perf_counter() - start)
    median = {name: statistics.median(s) if s else None for name, s in seconds.items()}
    ring, base = median.get("ring"), median.get("unsplit")
    rows = []
    for name, (compiled, _) in cases.items():
        m = median[name]
        rows.append(
            (
                str(t),
                name,
                f"{m * 1e3:,.0f} ms" if m else "-",
                f"{m / ring:.2f}x" if m and ring else "-",
                f"{m / base:.2f}x" if m and base else "-",
                mib(per_device(compiled)),
                collectives(compiled.as_text() or ""),
            )
        )
    if "unsplit" not in cases:
        rows.append((str(t), "unsplit", "-", "-", "-", f"{mib(per_device(plain))} (> --fit)", "-"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="short sequences, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", help="default 8192 32768")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--fit", type=int, default=4 * 2**30, help="bytes unsplit may use")
    parser.add_argument("--no-time", action="store_true", help="compile only: bytes, HLO")
    parser.add_argument("--out", type=Path, help="the results file (default: results/)")
    args = parser.parse_args()
    lengths, repeats = ([1024, 4096], 1) if args.quick else ([8192, 32768], args.repeats)
    lengths = args.lengths or lengths
    default = RESULTS / f"context_attention_cpu{'_quick' if args.quick else ''}.txt"
    with recorded(args.out or default):
        print(
            f"jax {jax.__version__}, {jax.device_count()} x {jax.default_backend()}; "
            f"(1, T, H={args.heads}, D={args.dim}) float32, forward + backward; "
            f"context axis of {jax.device_count()}; "
            + ("compiled only" if args.no_time else f"medians of {repeats}")
        )
        rows = [("T", "case", "time", "/ring", "/unsplit", "bytes/device", "collectives")]
        for t in lengths:
            rows += run(t, args.heads, args.dim, repeats, args.fit, not args.no_time)
        print_table(rows, right={0, 2, 3, 4, 5})


if __name__ == "__main__":
    main()
