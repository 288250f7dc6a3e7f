"""`auto_plan`'s search reads as its phases: `search.PHASES` names them in order, each a
function of its own module, and `auto_plan` calls them in that order; the dimensions it
weighs are registered in one tuple, each a `Dimension`, and a dimension registered there
(a toy one, here) has its layouts proposed, compiled, costed and ranked."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import eqxshard
from eqxshard._plans.auto import search
from eqxshard._plans.auto.dimensions import registry
from eqxshard._plans.auto.dimensions.base import Dimension, Proposal
from eqxshard._plans.auto.layout import Layout

PACKAGE = "eqxshard._plans.auto"


def _phase(entry: str):
    module, name = entry.rsplit(".", 1)
    return importlib.import_module(f"{PACKAGE}.{module}"), name


def test_the_phases_are_modules_in_the_order_they_run():
    assert [e.rsplit(".", 1)[1] for e in search.PHASES] == [
        "trace",
        "propose",
        "measure",
        "scale",
        "refine",
        "rank",
    ]
    for entry in search.PHASES:
        module, name = _phase(entry)
        assert callable(getattr(module, name)), entry


def test_auto_plan_calls_the_phases_in_that_order():
    tree = ast.parse(textwrap.dedent(inspect.getsource(search.auto_plan)))
    names = {e.rsplit(".", 1)[1] for e in search.PHASES}
    ordered = sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)),
        key=lambda n: (n.lineno, n.col_offset),
    )
    calls = [n.func.id for n in ordered if n.func.id in names]  # type: ignore[union-attr]
    assert calls == [e.rsplit(".", 1)[1] for e in search.PHASES]
    # Each name called is the phase's own function, as `search` imports it.
    for entry in search.PHASES:
        module, name = _phase(entry)
        assert getattr(search, name) is getattr(module, name)


def test_the_registry_holds_the_known_dimensions_each_a_dimension():
    assert [d.name for d in registry.DIMENSIONS] == [
        "data_fsdp_tensor",
        "stage",
        "offload",
        "remat",
        "context",
        "experts",
    ]
    hooks = ("propose", "cost", "choices", "scale", "refine", "explain")
    for d in registry.DIMENSIONS:
        assert isinstance(d, Dimension)
        # Each overrides at least one hook: it does something of its own.
        assert any(getattr(type(d), h) is not getattr(Dimension, h) for h in hooks), d.name


class Toy(Dimension):
    """A dimension of one layout: replicated over `data`, its step said to take half the
    time its compile gives (its own cost model), noted in its row."""

    name = "toy"

    def propose(self, traced):
        shape = {"data": traced.devices}
        return Proposal(layouts=(Layout("toy", shape, P(), note="a toy layout"),))

    def cost(self, c, layout, traced, recompute):
        if layout.name != "toy" or c.time is None:
            return c
        return dataclasses.replace(c, time=c.time / 2)


def _step(model, batch):
    return jnp.mean(jax.vmap(model)(batch) ** 2)


def test_a_registered_dimension_has_its_layouts_proposed_measured_and_ranked(monkeypatch):
    monkeypatch.setattr(registry, "DIMENSIONS", (*registry.DIMENSIONS, Toy()))
    model = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0))
    batch = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    plan = eqxshard.auto_plan(_step, model, batch, devices=2, budget="1GiB", progress=False)
    (toy,) = [c for c in plan.table if c.name == "toy"]
    (dp,) = [c for c in plan.table if c.name == "DP"]
    # The same mesh and rule as DP, compiled once (the cache key): its own cost halves it.
    assert toy.mesh_shape == dp.mesh_shape == {"data": 2}
    assert toy.bytes == dp.bytes and toy.time == dp.time / 2  # type: ignore[operator]
    assert plan.chosen is toy and "a toy layout" in toy.reason
