"""Bad inputs to the placement verbs: `filter_shard`, `filter_replicate`, `filter_put`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import eqxshard

from . import Case

_mesh = jax.make_mesh((2, 4), ("data", "model"))

CASES: list[Case] = [
    Case(
        "filter_shard/indivisible",
        lambda: eqxshard.filter_shard({"w": jnp.ones((3, 4))}, _mesh, P("data")),
        ValueError,
        r"\['w'\]",
    ),
]
