"""A pipelined `Stacked` against the plain scan of the same layers, on 8 CPU devices.

One training step (`value_and_grad` of a mean-square loss, under `jit`) of a stack of `n`
residual MLP blocks, each written per example and batched by `jax.vmap`:

- `scan, data=8`: the plain `lax.scan` (`Stacked` without `axis`), the weights replicated,
  the batch split over 8 devices: data parallelism alone.
- `scan, data=2`: the same on the pipeline's mesh, the batch split over `"data"` only, so
  each device runs all the layers on the rows a pipeline's device sees.
- `GPipe, M=...` and `circular R=2, M=...`: `Stacked(axis="stage", ...)` on a
  `(stage=4, data=2)` mesh, the layer dim laid out over `"stage"` by `eqxshard.stages`.

For each: the step's time as a ratio to the plain scan's (medians, interleaved in one
run), the bytes per device from `compiled.memory_analysis()` (arguments, i.e. weights and
batch, and temporaries), and the bubble measured from the compiled program: the trip
count `T` of the pipeline's loop (the `while` whose body holds the collective permute) and
the ticks each stage works, `M*R` microbatch-passes, so idle stage-ticks are `S*(T - M*R)`
and the bubble `(T - M*R)/T`, beside the formula `(S-1)/(M*R+S-1)`.

`temp/DP` is the temporaries over data parallelism's (`scan, data=8`). A device of the
pipeline runs `n/S` layers on `B/(2M)` rows per tick for `T` ticks, where data
parallelism runs `n` layers on `B/8` rows once: the same work when no tick idles, but the
loop's `S-1` idle ticks compute on zeros and keep their residuals for the backward pass
like the others, so the activations kept grow by `T/(M*R)` (`ticks/work`). A circular
schedule also keeps, at each tick, the chunk of weights the tick picked (`T` chunks of
`n/(S*R)` layers). The rest is each stage's weight gradients and the loop's buffers of
`M` microbatches (input, output, and the circular schedule's second pass).

On CPU devices that share two cores the times say little about a real pipeline (every
"device" competes for the same cores, and idle ticks still compute, masked); the bytes and
the bubble are what carry over.

A second table puts GPipe beside 1F1B in bytes per device, for `M = 2S` and `4S`
microbatches: the SPMD GPipe step's `memory_analysis()` (arguments, outputs and
temporaries), and `eqxshard.pipeline_value_and_grad` (each stage its own programs) in its
GPipe and 1F1B orders, where the driver records after each tick how many microbatches'
residuals each stage holds, their bytes on its fullest device, and the bytes of all live
arrays (`jax.live_arrays()`) per device over those before the step: the step's peak.

    python benchmarks/pipeline.py [--quick] [--repeats 7] [--only spmd|mpmd]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

import jax

if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import eqxshard  # noqa: E402

S = 4  # stages


class Block(eqx.Module):
    up: jax.Array
    down: jax.Array

    def __init__(self, key, dim, hidden):
        k1, k2 = jax.random.split(key)
        self.up = jax.random.normal(k1, (dim, hidden)) / dim**0.5
        self.down = jax.random.normal(k2, (hidden, dim)) / hidden**0.5

    def __call__(self, h):  # one example, (T, dim)
        return h + jax.nn.gelu(h @ self.up) @ self.down


def loss(stack, x):
    return jnp.mean(jax.vmap(stack)(x) ** 2)


def trip_counts(hlo: str) -> list[int]:
    """The trip counts of the `while` loops whose body holds a collective permute."""
    bodies = {}
    for match in re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S | re.M):
        bodies[match.group(1)] = match.group(2)
    found = []
    for line in hlo.splitlines():
        if " while(" not in line:
            continue
        body = re.search(r"body=%?([\w.\-]+)", line)
        count = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        if body and count and "collective-permute" in bodies.get(body.group(1), ""):
            found.append(int(count.group(1)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer repeats")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", choices=["spmd", "mpmd"], help="one of the two tables")
    args = parser.parse_args()
    n, dim, hidden, batch, tokens = (8, 64, 256, 32, 8) if args.quick else (16, 128, 512, 64, 16)
    repeats = 3 if args.quick else args.repeats

    blocks = eqx.filter_vmap(lambda k: Block(k, dim, hidden))(
        jax.random.split(jax.random.key(0), n)
    )
    x = jax.random.normal(jax.random.key(1), (batch, tokens, dim))
    auto = (AxisType.Auto, AxisType.Auto)
    data_mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    pipe_mesh = jax.make_mesh((S, 2), ("stage", "data"), axis_types=auto)

    print(
        f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].platform}; "
        f"{n} blocks of {dim}x{hidden}, batch {batch} x {tokens} tokens, S={S} stages"
    )
    if args.only != "mpmd":
        spmd_table(blocks, x, data_mesh, pipe_mesh, repeats)
    if args.only != "spmd":
        mpmd_table(blocks, x, pipe_mesh)


def spmd_table(blocks, x, data_mesh, pipe_mesh, repeats) -> None:
    cases = {}
    plain = eqxshard.filter_replicate(eqxshard.Stacked(blocks), data_mesh)
    cases["scan, data=8"] = (plain, jax.device_put(x, NamedSharding(data_mesh, P("data"))), 0, 0)
    xs = jax.device_put(x, NamedSharding(pipe_mesh, P("data")))
    # The same plain scan on the pipeline's mesh: each device then runs every layer on the
    # rows a pipeline's device sees (the batch split over "data" only).
    cases["scan, data=2"] = (
        eqxshard.filter_replicate(eqxshard.Stacked(blocks), pipe_mesh),
        xs,
        0,
        0,
    )
    for label, m, r in [
        (f"GPipe, M={S}", S, 1),
        (f"GPipe, M={2 * S}", 2 * S, 1),
        (f"circular R=2, M={S}", S, 2),
    ]:
        stack = eqxshard.Stacked(blocks, axis="stage", microbatches=m, repeats=r, mesh=pipe_mesh)
        stack = eqxshard.filter_shard(
            stack, pipe_mesh, eqxshard.stages("stage", path=r"blocks\..*")
        )
        cases[label] = (stack, xs, m, r)

    step = jax.jit(jax.value_and_grad(loss))
    compiled, reference = {}, None
    for label, (stack, xb, _, _) in cases.items():
        compiled[label] = step.lower(stack, xb).compile()
        value, _ = compiled[label](stack, xb)
        reference = value if reference is None else reference
        assert abs(float(value) - float(reference)) <= 1e-4 * abs(float(reference)), label

    times: dict[str, list[float]] = {label: [] for label in cases}
    for _ in range(repeats):  # interleaved, so load changes hit every case alike
        for label, (stack, xb, _, _) in cases.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled[label](stack, xb))
            times[label].append(time.perf_counter() - start)

    base = statistics.median(times["scan, data=8"])
    base_memory = compiled["scan, data=8"].memory_analysis()
    assert base_memory is not None
    print(f"One training step, pipelined and not (times: medians of {repeats})")
    header = (
        "case",
        "time",
        "weights+batch/device",
        "temp/device",
        "temp/DP",
        "ticks/work",
        "loop T",
        "idle S*(T-MR)",
        "bubble",
        "(S-1)/(MR+S-1)",
    )
    rows: list[list[str]] = [list(header)]
    for label, (_, _, m, r) in cases.items():
        memory = compiled[label].memory_analysis()
        assert memory is not None  # CPU, GPU and TPU backends give it
        ratio = statistics.median(times[label]) / base
        row = [
            label,
            f"{ratio:.2f}x",
            f"{memory.argument_size_in_bytes / 2**10:.0f} KiB",
            f"{memory.temp_size_in_bytes / 2**10:.0f} KiB",
            f"{memory.temp_size_in_bytes / base_memory.temp_size_in_bytes:.2f}x",
        ]
        if m:
            counts = trip_counts(compiled[label].as_text())
            loop = max(counts) if counts else 0
            work = m * r
            row += [
                f"{loop / work:.2f}",
                str(loop),
                str(S * (loop - work)),
                f"{(loop - work) / loop:.1%}" if loop else "-",
                f"{(S - 1) / (work + S - 1):.1%}",
            ]
        else:
            row += ["-", "-", "-", "-", "-"]
        rows.append(row)
    _print(rows)
    print(f"(time: the step's median over the plain scan's, {base * 1e3:.1f} ms)")


def _print(rows: list[list[str]]) -> None:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _live_per_device() -> dict:
    per: dict = {}
    for a in jax.live_arrays():
        for shard in a.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return per


def mpmd_table(blocks, x, pipe_mesh) -> None:
    """GPipe (SPMD, `memory_analysis`) against the MPMD pipeline in its GPipe and 1F1B
    orders (the residuals its driver holds, and every live array), in bytes per device."""
    stack = eqxshard.filter_shard(blocks, pipe_mesh, eqxshard.stages("stage"))
    xs = jax.device_put(x, NamedSharding(pipe_mesh, P("data")))
    layer = lambda block, h: jax.vmap(block)(h)  # noqa: E731
    mse = lambda y: jnp.mean(y**2)  # noqa: E731
    step = jax.jit(jax.value_and_grad(loss))
    rows = [
        [
            "case",
            "residuals held per stage",
            "residuals/device",
            "peak bytes/device",
            "over SPMD GPipe's",
        ]
    ]
    for m in (2 * S, 4 * S):
        piped = eqxshard.Stacked(blocks, axis="stage", microbatches=m, mesh=pipe_mesh)
        piped = eqxshard.filter_shard(
            piped, pipe_mesh, eqxshard.stages("stage", path=r"blocks\..*")
        )
        memory = step.lower(piped, xs).compile().memory_analysis()
        assert memory is not None
        spmd = memory.argument_size_in_bytes + memory.output_size_in_bytes
        spmd += memory.temp_size_in_bytes
        rows.append([f"GPipe (SPMD), M={m}", f"{m} (all)", "-", f"{spmd / 2**10:.0f} KiB", "1.00x"])
        reference = float(step(piped, xs)[0])
        for schedule in ("gpipe", "1f1b"):
            counts, held, live = [], [], []
            before = _live_per_device()

            def record(c, b, counts=counts, held=held, live=live, before=before):
                counts.append(c)
                held.append(max(b))
                now = _live_per_device()
                live.append(max(v - before.get(d, 0) for d, v in now.items()))

            value, grads = eqxshard.pipeline_value_and_grad(
                layer,
                stack,
                xs,
                mse,
                mesh=pipe_mesh,
                microbatches=m,
                schedule=schedule,
                on_tick=record,
            )
            assert abs(float(value) - reference) <= 1e-4 * abs(reference), schedule
            del grads
            peaks = [max(c[s] for c in counts) for s in range(S)]
            # the weights and batch are live before the step: add them, as SPMD's arguments
            peak = max(live) + memory.argument_size_in_bytes
            rows.append(
                [
                    f"{'GPipe order' if schedule == 'gpipe' else '1F1B'} (MPMD), M={m}",
                    str(peaks),
                    f"{max(held) / 2**10:.0f} KiB",
                    f"{peak / 2**10:.0f} KiB",
                    f"{peak / spmd:.2f}x",
                ]
            )
    print("GPipe against 1F1B, bytes per device")
    _print(rows)


if __name__ == "__main__":
    main()
