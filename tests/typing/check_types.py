"""Checked by pyright in CI (`.ci/run`, lint), never run: the verbs that return their
input's structure keep its static type, so a user's editor still knows it holds a model.

`assert_type` fails the pyright run if the inferred type differs (e.g. `Any`).
"""

import re
from typing import assert_type

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import eqxshard


def check_types(mesh: jax.sharding.Mesh) -> None:
    model = eqx.nn.MLP(2, 2, 8, 1, key=jax.random.key(0))
    assert_type(eqxshard.filter_shard(model, mesh, P()), eqx.nn.MLP)
    assert_type(eqxshard.filter_shard(model, jax.devices()[0]), eqx.nn.MLP)
    assert_type(eqxshard.filter_replicate(model, mesh), eqx.nn.MLP)
    assert_type(eqxshard.filter_put(model, memory_kind="pinned_host"), eqx.nn.MLP)
    assert_type(eqxshard.filter_restore("/tmp/run", model, mesh), eqx.nn.MLP)

    pair = (jnp.ones(3), {"b": jnp.zeros(2)})
    assert_type(eqxshard.filter_shard(pair, mesh), tuple[jax.Array, dict[str, jax.Array]])

    # filter_get keeps the tree's type (its array leaves come back as NumPy).
    assert_type(eqxshard.filter_get(model), eqx.nn.MLP)
    assert_type(eqxshard.filter_get(pair), tuple[jax.Array, dict[str, jax.Array]])

    # filter_init returns a function taking `make`'s arguments and returning its type.
    def make(key: jax.Array, width: int = 8) -> eqx.nn.MLP:
        return eqx.nn.MLP(2, 2, width, 1, key=key)

    assert_type(eqxshard.filter_init(make, mesh, P())(jax.random.key(0)), eqx.nn.MLP)
    assert_type(eqxshard.filter_init(make, mesh)(jax.random.key(0), width=4), eqx.nn.MLP)

    # filter_map keeps the mapped function's signature, called directly or as a decorator.
    def f(x: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
        return x * scale, x

    assert_type(
        eqxshard.filter_map(f, batch_size=2)(jnp.ones((4, 3)), 2.0), tuple[jax.Array, jax.Array]
    )

    @eqxshard.filter_map(batch_size=2)
    def g(x: jax.Array) -> jax.Array:
        return x + 1

    assert_type(g(jnp.ones((4, 3))), jax.Array)

    # path_rules takes a dict keyed by strings, by compiled patterns, or by both.
    by_string: dict[str, P | None] = {r".*bias": None, r".*": P()}
    either: dict[str | re.Pattern[str], P | None] = {re.compile(r".*"): P()}
    by_pattern: dict[re.Pattern[str], P] = {re.compile(r".*"): P()}
    by_bare_pattern: dict[re.Pattern, P | None] = {re.compile(r".*"): None}
    eqxshard.path_rules(by_string)
    eqxshard.path_rules(either)
    eqxshard.path_rules(by_pattern)
    eqxshard.path_rules(by_bare_pattern)
    eqxshard.path_rules([(re.compile(r".*"), P())])
    eqxshard.path_rules({re.compile(r".*"): P()})
    eqxshard.path_rules({re.compile(r".*bias"): None, r".*": P()})

    # filter_jit keeps the function's signature, called directly or as a decorator.
    assert_type(eqxshard.filter_jit(f)(jnp.ones(3), 2.0), tuple[jax.Array, jax.Array])

    @eqxshard.filter_jit(donate=(True,), out_shardings=P())
    def h(x: jax.Array) -> jax.Array:
        return x + 1

    assert_type(h(jnp.ones(3)), jax.Array)
