"""`batch_size="auto"`: the search, the default budget, and `filter_map` under a budget."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eqxshard
from eqxshard._mapping import budget as _budget


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    step=st.integers(1, 8),
    per_row=st.integers(1, 50),
    base=st.integers(0, 100),
    budget=st.integers(0, 20000),
)
def test_search_finds_the_largest_fitting_multiple(n, step, per_row, base, budget):
    calls = []

    def measure(k):
        calls.append(k)
        return base + per_row * k

    top = -(-n // step) * step
    fits = [k for k in range(step, top + 1, step) if measure(k) <= budget]
    calls.clear()
    if not fits:
        with pytest.raises(
            ValueError, match=rf"`memory_budget={budget:,}`.*{base + per_row * step:,}"
        ):
            _budget.largest_fitting(measure, n, budget, step, "f")
        return
    k = _budget.largest_fitting(measure, n, budget, step, "f")
    assert k == max(fits)
    assert len(calls) <= 3 + top.bit_length()  # a binary search, not a sweep


def test_default_budget_is_a_fraction_of_the_reported_memory(monkeypatch):
    class Device:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 1000}

    monkeypatch.setattr(_budget.jax, "devices", lambda: [Device()])
    assert _budget.resolve_budget(None, "f") == int(1000 * _budget.DEFAULT_FRACTION)
    assert _budget.resolve_budget(123, "f") == 123


def test_default_budget_on_cpu_asks_for_memory_budget():
    with pytest.raises(ValueError, match=r"`f\(batch_size=\"auto\"\)`.*`memory_budget=`"):
        _budget.resolve_budget(None, "f")


def _rows(x):  # a jacobian per row: large temporaries that grow with the chunk
    def g(v):
        m = jnp.tanh(jnp.outer(v, v))
        return jnp.tanh(m @ m).sum(1)

    return jax.jacrev(g)(x)


def _temps(fn, *args):
    memory = jax.jit(fn).lower(*args).compile().memory_analysis()
    assert memory is not None  # the CPU backend reports it
    return memory.temp_size_in_bytes


def test_filter_map_auto_fits_the_budget_and_matches_vmap():
    x = jax.random.normal(jax.random.key(0), (24, 16))
    full = _temps(eqxshard.filter_map(_rows, batch_size=24), x)
    budget = full // 4
    mapped: Any = eqxshard.filter_map(_rows, batch_size="auto", memory_budget=budget)
    np.testing.assert_allclose(mapped(x), eqx.filter_vmap(_rows)(x), rtol=1e-5, atol=1e-5)
    (k,) = mapped._auto.cache.values()  # the size the search chose (not searched again)
    assert 1 <= k < 24
    assert _temps(eqxshard.filter_map(_rows, batch_size=k), x) <= budget
    assert _temps(eqxshard.filter_map(_rows, batch_size=k + 1), x) > budget


def test_filter_map_auto_under_jit_and_as_decorator():
    x = jax.random.normal(jax.random.key(1), (10, 8))

    @eqxshard.filter_map(batch_size="auto", memory_budget=2**30)
    def f(row):
        return jnp.sin(row) * 2

    np.testing.assert_allclose(jax.jit(f)(x), jnp.sin(x) * 2, rtol=1e-6)


def test_auto_with_non_array_outputs():
    # The search compiles the program for its memory: it keeps only the array outputs, so
    # a non-array output (returned as `filter_map` returns it at an int size) does not fail.
    x = jnp.ones((6, 3))
    mapped = eqxshard.filter_map(lambda r: (r * 2, "tag"), batch_size="auto", memory_budget=2**30)
    out, tag = mapped(x)
    assert tag == "tag"
    np.testing.assert_allclose(out, x * 2)


def test_batched_leaves_reads_one_vmap_and_gives_up_on_two():
    seen = []

    def record(*leaves):
        seen.append(_budget.batched_leaves(list(leaves)))
        return leaves[0]

    x, y = jnp.ones((3, 5)), jnp.ones(4)
    jax.jit(jax.vmap(record, (1, None)))(x, y)
    vals, dims = seen.pop()
    assert [v.shape for v in vals] == [(3, 5), (4,)] and dims == (1, None)
    record(x, y)
    assert seen.pop() is None  # not under vmap
    jax.vmap(lambda a: jax.vmap(lambda b: record(a, b))(x))(x)  # two vmaps, one leaf each
    assert seen.pop() is None
    jax.vmap(jax.vmap(record))(x[:, :, None], x[:, :, None])  # both leaves by the inner one
    vals, dims = seen.pop()
    assert [v.shape for v in vals] == [(5, 1)] * 2 and dims == (0, 0)


def test_filter_map_auto_under_nested_vmap():
    f = eqxshard.filter_map(lambda r: jnp.sin(r) * 2, batch_size="auto", memory_budget=2**30)
    x = jax.random.normal(jax.random.key(2), (2, 3, 6, 4))
    np.testing.assert_allclose(jax.vmap(jax.vmap(f))(x), jnp.sin(x) * 2, rtol=1e-6)
    got = jax.vmap(lambda a: jax.vmap(lambda b: f(a) + f(b))(x[0]))(x[1])  # two vmaps
    np.testing.assert_allclose(got, 2 * jnp.sin(x[1][:, None]) + 2 * jnp.sin(x[0]), rtol=1e-6)
