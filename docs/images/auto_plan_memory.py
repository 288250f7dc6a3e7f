"""Draws docs/images/auto_plan_memory.svg: the memory chart of the plan in docs/auto_plan.md
where pipeline stages, rematerialisation and optimiser offload are all chosen.

One bar per compiled candidate, its bytes per device split into parameters, gradients,
optimiser state, batch and activations, against the budget (the red line); a thin bar
under it for what it holds in host memory (the optimiser state, when offloaded). The
figures are the plan's own (`Plan.table`), drawn as a notebook shows the plan.

    python docs/images/auto_plan_memory.py [OUTPUT.svg]
"""

from __future__ import annotations

import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqxshard
from eqxshard._plans.auto.view import svg  # the chart a notebook shows

optimizer = optax.adamw(1e-3)  # as docs/auto_plan.md


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up, self.down = eqx.nn.Linear(32, 512, key=k1), eqx.nn.Linear(512, 32, key=k2)

    def __call__(self, h):
        return h + jax.vmap(self.down)(jnp.tanh(jax.vmap(self.up)(h)))


class Decoder(eqx.Module):
    embed: eqx.nn.Linear
    blocks: eqxshard.Stacked
    head: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.head)(self.blocks(jax.vmap(self.embed)(x)))


def make_decoder(key, layers=4):
    k1, k2, k3 = jax.random.split(key, 3)
    blocks = eqx.filter_vmap(Block)(jax.random.split(k2, layers))
    return Decoder(
        eqx.nn.Linear(8, 32, key=k1), eqxshard.Stacked(blocks), eqx.nn.Linear(32, 8, key=k3)
    )


def step(model, opt_state, batch):
    x, y = batch
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def plan() -> eqxshard.Plan:
    """The plan of docs/auto_plan.md: four layers on 2 devices, the data, fsdp and model
    axes on slow links, 3.75 MiB per device."""
    slow = eqxshard.links.Link(bandwidth=1e8, latency=1e-3)
    tokens = (jax.ShapeDtypeStruct((16, 32, 8), jnp.float32),) * 2
    links = {"data": slow, "fsdp": slow, "model": slow}
    options = dict(devices=2, budget="3.75MiB", optimizer=optimizer, links=links)
    return eqxshard.auto_plan(step, make_decoder(jax.random.key(0)), tokens, **options)


def draw(chosen: eqxshard.Plan, out: Path) -> str:
    """Writes the chart of `chosen` to `out`; returns the SVG text."""
    text = svg(chosen.table, chosen.budget)
    out.write_text(text + "\n")
    return text


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backends
    default = Path(__file__).with_name("auto_plan_memory.svg")
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    made = plan()
    draw(made, target)
    print(made.summary())
    print(f"wrote {target}")
