"""`auto_plan` on a GPT-style decoder, against a brute force that compiles every candidate.

A decoder of about 135M parameters (GPT-2 small's shape: width 768, 12 layers, 12 heads,
MLP 3072, a 32768-token vocabulary, layers scanned), trained by the step and AdamW of
`_decoder.py` (as the 7B and 70B benchmarks) on 8 CPU devices on batches of 16 sequences
of 128 tokens (`--batch 4`: 4 sequences, which cannot be split 8 ways, so that FSDP over
all 8 devices is out), for three budgets per device: a generous one; one where data
parallel does not fit; and
one where only FSDP x TP layouts fit (the latter two are read off the generous run's
table: just under the smallest data-parallel footprint (or, when the batch cannot split
8 ways, under its parameters, gradients and AdamW moments, replicated), and just over the smallest
FSDP x TP footprint when every other family needs more; when another family needs less,
the third budget is 2% over the smallest footprint of all, and the output says so).

For each budget it prints the chosen layout, its compiled bytes per device and the bytes
its collectives send, `auto_plan`'s own wall time, and the brute force beside it: every
candidate compiled again here, independently (`jax.jit(..., out_shardings=...)` of the
step over shardings from `filter_shardings`), its bytes per device from `memory_analysis()`,
fit or not, and the best fitting one by estimated step time. Targets: the chosen plan
fits by the brute force's own compile; its estimated time is within 1.1x of the brute
force's best; `auto_plan` takes at most 2 minutes. Then 3 training steps under the
chosen plan give the losses of the unsharded run.

    python benchmarks/auto_plan.py [--small] [--batch N]

`--small` runs a 4-layer, width-256 decoder instead (for a quick look on a busy machine).
"""

from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _decoder import optimizer as OPTIMIZER, step  # noqa: E402  (benchmarks/_decoder.py)
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import eqxshard  # noqa: E402

FULL = dict(vocab=32768, width=768, heads=12, hidden=3072, depth=12, seq=128, batch=16)
SMALL = dict(vocab=4096, width=256, heads=4, hidden=1024, depth=4, seq=64, batch=16)


def decoder(vocab: int, width: int, heads: int, hidden: int, depth: int, **_: int) -> type:
    class Block(eqx.Module):
        norm1: eqx.nn.LayerNorm
        attention: eqx.nn.MultiheadAttention
        norm2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key: jax.Array):
            k1, k2, k3 = jax.random.split(key, 3)
            self.norm1, self.norm2 = eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width)
            self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
            self.up = eqx.nn.Linear(width, hidden, key=k2)
            self.down = eqx.nn.Linear(hidden, width, key=k3)

        def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
            h = jax.vmap(self.norm1)(x)
            x = x + self.attention(h, h, h, mask=mask)
            h = jax.vmap(self.norm2)(x)
            return x + jax.vmap(lambda v: self.down(jax.nn.gelu(self.up(v))))(h)

    class Decoder(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: Block  # `depth` blocks stacked, scanned over
        norm: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key: jax.Array):
            k1, k2, k3 = jax.random.split(key, 3)
            self.embed = eqx.nn.Embedding(vocab, width, key=k1)
            self.blocks = eqx.filter_vmap(Block)(jax.random.split(k2, depth))
            self.norm = eqx.nn.LayerNorm(width)
            self.head = eqx.nn.Linear(width, vocab, key=k3)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = jax.vmap(self.embed)(tokens)
            mask = jnp.tril(jnp.ones((tokens.shape[0],) * 2, bool))
            params, static = eqx.partition(self.blocks, eqx.is_array)
            body = lambda x, p: (eqx.combine(p, static)(x, mask), None)
            x, _ = jax.lax.scan(body, x, params)
            return jax.vmap(lambda v: self.head(self.norm(v)))(x)

    return Decoder


KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def brute_force(candidate, model, opt_state, batch):
    """The candidate compiled here, independently of `auto_plan`: bytes per device."""
    shape = candidate.mesh_shape
    mesh = jax.make_mesh(
        tuple(shape.values()), tuple(shape), axis_types=(AxisType.Auto,) * len(shape)
    )
    data = tuple(a for a in ("data", "fsdp") if a in shape)
    batch_spec = P(data if len(data) > 1 else data[0]) if data else P()

    def laid_out(tree, spec):
        plan = eqxshard.filter_shardings(tree, mesh, spec)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, plan
        )

    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    args = (laid_out(params, candidate.rules), laid_out(opt_state, candidate.rules))
    args += (laid_out(batch, batch_spec),)

    def run(params, opt_state, batch):
        new_model, new_state, loss = step(eqx.combine(params, static), opt_state, batch)
        return eqx.filter(new_model, eqx.is_array), new_state, loss

    out = (
        jax.tree.map(lambda x: x.sharding, args[0]),
        jax.tree.map(lambda x: x.sharding, args[1]),
        NamedSharding(mesh, P()),
    )
    compiled = jax.jit(run, donate_argnums=(0, 1), out_shardings=out).lower(*args).compile()
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return total + m.temp_size_in_bytes


def mib(n):
    return f"{n / 2**20:8.1f}"


def train(plan, make, batch_shape):
    """Losses of 3 steps under the plan and unsharded, on the same data."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 100, size=batch_shape).astype(np.int32)
    model = make(jax.random.key(0))
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    jitted = eqx.filter_jit(step)
    sharded = plan.shard(model, opt_state, tokens)
    state_a, state_b, losses = sharded[:2], (model, opt_state), []
    for _ in range(3):
        *state_a, loss_a = jitted(*state_a, sharded[2])
        *state_b, loss_b = jitted(*state_b, tokens)
        losses.append((float(loss_a), float(loss_b)))
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--batch", type=int, default=None)
    args = parser.parse_args()
    config = dict(SMALL if args.small else FULL)
    config["batch"] = args.batch or config["batch"]
    Decoder = decoder(**config)
    model = eqx.filter_eval_shape(Decoder, jax.random.key(0))
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(OPTIMIZER.init, params)
    batch = jax.ShapeDtypeStruct((config["batch"], config["seq"] + 1), jnp.int32)
    count = sum(x.size for x in jax.tree.leaves(params))
    print(f"decoder {config}: {count / 1e6:.0f}M parameters, AdamW, 8 CPU devices")

    start = time.perf_counter()
    generous = eqxshard.auto_plan(
        step, model, batch, devices=8, budget="16GiB", optimizer=OPTIMIZER, progress=False
    )
    first = time.perf_counter() - start
    measured = [c for c in generous.table if c.total_bytes is not None and c.time is not None]
    dps = [c.total_bytes for c in measured if c.name == "DP"]
    # Without a DP row (the batch does not split 8 ways): its parameters, gradients and
    # AdamW's two moments, whole on every device.
    dp = min(dps) if dps else 4 * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    both = [c.total_bytes for c in measured if "FSDP" in c.name and "TP" in c.name]
    others = [c.total_bytes for c in measured if not ("FSDP" in c.name and "TP" in c.name)]
    budgets = {"generous (16 GiB)": 16 * 2**30, "DP does not fit": int(dp * 0.98)}
    if both and min(both) < min(others):
        budgets["only FSDP x TP fits"] = int((min(both) + min(others)) / 2)
    else:
        smallest = min(c.total_bytes for c in measured)
        budgets["tight (smallest+2%)"] = int(smallest * 1.02)
        print(
            "No budget lets only FSDP x TP fit on this model: another family needs less "
            f"({min(others) / 2**20:.1f} MiB vs {min(both) / 2**20:.1f} MiB). The third budget "
            "is instead 2% over the smallest footprint of all."
        )
    print(f"\nauto_plan, generous budget ({first:.0f} s):\n{generous}")

    print("\nbrute force: every candidate compiled again here, independently")
    brute = {}
    for c in generous.table:
        if c.time is not None:
            brute[(c.name, tuple(c.mesh_shape.items()))] = brute_force(c, model, opt_state, batch)
    print(
        f"{'budget':22s} {'chosen':16s} {'mesh':26s} {'MiB/dev':>8s} {'brute':>8s} "
        f"{'sent MiB':>8s} {'time':>9s} {'best bf':>9s} {'ratio':>6s} {'auto_plan s':>11s}"
    )
    for label, budget in budgets.items():
        start = time.perf_counter()
        plan = eqxshard.auto_plan(
            step, model, batch, devices=8, budget=budget, optimizer=OPTIMIZER, progress=False
        )
        took = first if label.startswith("generous") else time.perf_counter() - start
        chosen = plan.chosen
        key = (chosen.name, tuple(chosen.mesh_shape.items()))
        fitting = [
            c
            for c in plan.table
            if c.time is not None and brute[(c.name, tuple(c.mesh_shape.items()))] <= budget
        ]
        best = min(c.time for c in fitting)
        mesh = " x ".join(f"{a}={s}" for a, s in chosen.mesh_shape.items())
        print(
            f"{label:22s} {chosen.name:16s} {mesh:26s} {mib(chosen.total_bytes)} "
            f"{mib(brute[key])} {mib(sum(chosen.collectives.values()))} "
            f"{chosen.time * 1e3:7.2f}ms {best * 1e3:7.2f}ms {chosen.time / best:6.2f} "
            f"{took:11.1f}"
        )
        assert brute[key] <= budget, "the chosen plan does not fit by the brute force's compile"
    print(
        "\nauto_plan's first call compiles every candidate; later calls (other budgets) "
        "reuse its cache."
    )

    # 3 steps under the last plan and unsharded: the same losses.
    losses = train(plan, Decoder, (8, 33))
    print(f"\n3 training steps under {plan.chosen.name} vs unsharded (batch 8 x 32 tokens):")
    for k, (a, b) in enumerate(losses):
        print(f"  step {k + 1}: loss {a:.6f} vs {b:.6f} (difference {abs(a - b):.1e})")
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in losses)


if __name__ == "__main__":
    main()
