"""`auto_plan` for the 7B decoder of docs/sizing.md on 512 devices, on this machine.

The decoder (Llama 7B's shapes: width 4096, 32 blocks, 32 heads, MLP 11008, a 32000-token
vocabulary), its blocks an `eqxshard.Stacked` (scanned, each layer rematerialised), trained with
AdamW on batches of 512 sequences of 2048 tokens; planned as shapes only
(`eqx.filter_eval_shape`) for an 80 GB accelerator. Meshes of more than `--compile-limit`
devices are estimated from compiles on at most that many. Prints the time it took and
the plan's table (docs/auto_plan.md shows it; benchmarks/results/auto_plan_7b_512.txt
holds a run).

    python benchmarks/auto_plan_7b.py [--devices 512] [--batch 512] [--compile-limit 8]
"""

from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _decoder import Decoder, Shape, optimizer, step  # noqa: E402  (benchmarks/_decoder.py)

import eqxshard  # noqa: E402

SHAPE = Shape(vocab=32000, width=4096, hidden=11008, heads=32, depth=32, seq=2048)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=512)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--compile-limit", type=int, default=8)
    args = parser.parse_args()
    model = eqx.filter_eval_shape(Decoder, SHAPE, jax.random.key(0))
    batch = jax.ShapeDtypeStruct((args.batch, SHAPE.seq + 1), jnp.int32)
    start = time.perf_counter()
    plan = eqxshard.auto_plan(
        step,
        model,
        batch,
        devices=args.devices,
        budget="80GB",
        optimizer=optimizer,
        compile_limit=args.compile_limit,
    )
    print(f"auto_plan took {time.perf_counter() - start:.0f} s")
    print(plan)


if __name__ == "__main__":
    main()
