"""Checked by pyright in CI (`.ci/run`, lint), never run: the verbs that return their
input's structure keep its static type, so a user's editor still knows it holds a model.

`assert_type` fails the pyright run if the inferred type differs (e.g. `Any`).
"""

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
