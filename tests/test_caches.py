"""Every cache eqxshard keeps is emptied by `eqxshard._caches.clear_all()`, and each verb
still works after it (compiling again): `filter_jit`'s entries, traced functions, `jax.jit`s
and leaf kinds, the programs the chunked Jacobians share, and the placement plans."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from helpers import make_mesh, make_model, named
from jax.sharding import PartitionSpec as P

import eqxshard
from eqxshard import _caches
from eqxshard._mapping import shared
from eqxshard._placement import cache
from eqxshard._step import entry, jit, leaves


def test_filter_jit_caches_are_emptied_and_the_step_traces_again():
    traces = []

    @eqxshard.filter_jit(donate="none")
    def step(x, scale):
        traces.append(1)
        return x * scale

    x = jnp.arange(4.0)
    np.testing.assert_array_equal(step(x, 2.0), np.arange(4.0) * 2)
    assert jit.SITES and entry.FUNS and entry.JITS and leaves.KINDS
    _caches.clear_all()
    assert not (jit.SITES or entry.FUNS or entry.JITS or leaves.KINDS)
    np.testing.assert_array_equal(step(x, 2.0), np.arange(4.0) * 2)
    assert len(traces) == 2  # traced again: nothing of the first call was kept
    assert jit.SITES and entry.FUNS and entry.JITS and leaves.KINDS


def test_step_loop_runs_after_the_caches_are_emptied():
    loop = eqxshard.StepLoop(lambda c, x: (c + x, jnp.sum(x)), jnp.zeros(3))
    loop(jnp.ones(3))
    _caches.clear_all()
    assert float(loop(jnp.ones(3))) == 3.0
    np.testing.assert_array_equal(loop.state[0], np.full(3, 2.0))


def test_shared_jacobian_programs_are_emptied_and_compiled_again():
    def energy(x):
        return jnp.sum(jnp.sin(x) ** 2)

    x = jnp.arange(6.0)
    expected = jax.hessian(energy)(x)
    np.testing.assert_allclose(eqxshard.filter_hessian(energy, batch_size=2)(x), expected)
    assert shared.SHARED
    _caches.clear_all()
    assert not shared.SHARED
    np.testing.assert_allclose(eqxshard.filter_hessian(energy, batch_size=2)(x), expected)
    assert shared.SHARED


def test_placement_plans_are_emptied_and_the_call_is_resolved_again():
    mesh = make_mesh("auto", (8,), ("data",))
    model = make_model()
    eqxshard.filter_shard(model, mesh, P())
    placed = eqxshard.filter_shard(model, mesh, P())
    assert cache.PLANS and cache.counts()["hits"] >= 1
    _caches.clear_all()
    assert not cache.PLANS and cache.counts() == {"hits": 0, "misses": 0}
    again = eqxshard.filter_shard(model, mesh, P())
    assert cache.counts() == {"hits": 0, "misses": 1}
    for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(placed), strict=True):
        if eqx.is_inexact_array(x):
            assert x.sharding.is_equivalent_to(named(mesh), x.ndim)
            np.testing.assert_array_equal(x, y)
