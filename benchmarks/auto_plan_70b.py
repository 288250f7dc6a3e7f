"""`auto_plan` for a 70B decoder on 1024 devices of 8 per node, on this machine.

The decoder has Llama-2-70B's shapes: width 8192, 80 blocks, 64 query heads sharing 8
key/value heads (grouped-query attention, heads of 128), an MLP of 28672 with a SiLU
gate, a 32000-token vocabulary; 68.98 billion parameters. Its blocks are stacked and
scanned in an `eqxshard.Stacked`, each layer rematerialised, trained with AdamW on
batches of 1024 sequences of 4096 tokens (4M tokens a step), planned as shapes only
(`eqx.filter_eval_shape`) for an 80 GB accelerator, with 8 devices a node
(`devices_per_node=8`: the mesh axes that span nodes get the `inter_node` link). Meshes
of more than `--compile-limit` devices are estimated from compiles on at most that many.
Prints the time it took and the plan's table (docs/sizing.md shows it;
benchmarks/results/auto_plan_70b_1024.txt holds a run).

    python benchmarks/auto_plan_70b.py [--devices 1024] [--batch 1024] [--compile-limit 8]
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

SHAPE = Shape(vocab=32000, width=8192, hidden=28672, heads=64, depth=80, seq=4096, kv_heads=8)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--compile-limit", type=int, default=8)
    args = parser.parse_args()
    model = eqx.filter_eval_shape(Decoder, SHAPE, jax.random.key(0))
    count = sum(x.size for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct))
    batch = jax.ShapeDtypeStruct((args.batch, SHAPE.seq + 1), jnp.int32)
    start = time.perf_counter()
    plan = eqxshard.auto_plan(
        step,
        model,
        batch,
        devices=args.devices,
        devices_per_node=8,
        budget="80GB",
        optimizer=optimizer,
        compile_limit=args.compile_limit,
    )
    print(f"{count:,} parameters; auto_plan took {time.perf_counter() - start:.0f} s")
    print(plan)


if __name__ == "__main__":
    main()
