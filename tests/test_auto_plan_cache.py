"""`auto_plan`'s cache of compiled steps: emptied by `eqxshard._caches.clear_all` (what
`eqxshard.clear_caches` calls), and keyed so that an unhashable static is never taken
for another object that got its `id`."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

import eqxshard
from eqxshard._caches import clear_all
from eqxshard._plans.auto.measure import batch_proxies
from eqxshard._plans.auto.measure.cache import CACHE, Identity, shapes_key


class Unhashable:
    """A static leaf that does not hash (as a list or a dict would not)."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: int):
        self.value = value


def _step(model, batch):
    return jnp.mean(jax.vmap(model)(batch) ** 2)


def test_clear_all_empties_the_search_cache():
    model = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0))
    batch = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    eqxshard.auto_plan(_step, model, batch, devices=2, budget="1GiB", progress=False)
    assert CACHE
    clear_all()
    assert CACHE == {} and batch_proxies.ESTIMATES == {}


def test_an_unhashable_static_is_keyed_by_the_object_itself():
    first = Unhashable(1)
    key = shapes_key({"w": jax.ShapeDtypeStruct((2,), jnp.float32), "s": first})
    assert key == shapes_key({"w": jax.ShapeDtypeStruct((2,), jnp.float32), "s": first})
    seen = id(first)
    del first  # the key keeps it alive: its id is not free for the next object
    again = Unhashable(1)
    other = shapes_key({"w": jax.ShapeDtypeStruct((2,), jnp.float32), "s": again})
    assert id(again) != seen and other != key
    assert key[1][0].obj.value == 1  # the first object, still there


def test_identities_are_equal_only_for_the_same_object():
    a, b = Unhashable(1), Unhashable(1)
    assert Identity(a) == Identity(a) and hash(Identity(a)) == hash(Identity(a))
    assert Identity(a) != Identity(b) and Identity(a) != id(a)
