"""The chunked Jacobian verbs compile once per input signature, also when the verb is
written out at every call (`filter_hessian(f, batch_size=3)(x)`, as users write
`jax.hessian(f)(x)`): JAX's own `test_api_vmap_caching` (jax#7621) on every chunked path."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import test_util as jax_test_util

import eqxshard


def _energy(x):
    return jnp.sum(jnp.sin(x) ** 3)


VERBS = {
    "hessian": (eqxshard.filter_hessian, jax.jit(_energy), jax.hessian(_energy)),
    "jacfwd": (eqxshard.filter_jacfwd, jax.jit(jax.grad(_energy)), jax.hessian(_energy)),
    "jacrev": (eqxshard.filter_jacrev, jax.jit(jax.grad(_energy)), jax.hessian(_energy)),
}


# Across a mesh of 8 devices a chunk is a multiple of 8 basis vectors.
CHUNKS = [(1, False), (3, False), ("auto", False), (8, True), (16, True), ("auto", True)]


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize(("batch_size", "on_mesh"), CHUNKS)
def test_lowered_once_per_signature_however_often_the_verb_is_made(verb, batch_size, on_mesh):
    make, fun, reference = VERBS[verb]
    x = jnp.arange(16.0)
    options: dict = {"batch_size": batch_size}
    if batch_size == "auto":
        options["memory_budget"] = 1e6
    if on_mesh:
        options["mesh"] = jax.make_mesh((8,), ("data",))
    out: Any = None
    with jax_test_util.count_jit_and_pmap_lowerings() as count:
        for _ in range(3):
            out = make(fun, **options)(x)
        warm = count()
        for _ in range(5):
            out = make(fun, **options)(x)
        assert count() == warm
    np.testing.assert_allclose(out, reference(x), rtol=1e-5, atol=1e-6)
    with jax_test_util.count_jit_and_pmap_lowerings() as count:
        make(fun, **options)(jnp.arange(24.0))  # a new signature: compiled anew
        assert count() >= 1


def test_a_function_that_cannot_be_hashed_gets_a_cache_of_its_own():
    # A module holding arrays is no cache key: each verb made of it keeps its own programs.
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    x = jnp.linspace(0.0, 1.0, 3)
    for _ in range(2):
        jac = eqxshard.filter_jacfwd(mlp, batch_size=2)(x)
        np.testing.assert_allclose(jac, jax.jacfwd(mlp)(x), rtol=1e-5, atol=1e-6)


def _closure():
    """A function closing over an array, and a weak reference to that array."""
    import weakref

    weights = jnp.linspace(0.0, 1.0, 16)

    def fun(x):
        return jnp.sum(jnp.sin(x * weights) ** 3)

    return fun, weakref.ref(weights)


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize(("batch_size", "on_mesh"), [(3, False), ("auto", False), (8, True)])
def test_the_shared_cache_keeps_no_function_or_closed_over_array_alive(verb, batch_size, on_mesh):
    import gc
    import weakref

    make = VERBS[verb][0]
    options: dict = {"batch_size": batch_size}
    if batch_size == "auto":
        options["memory_budget"] = 1e6
    if on_mesh:
        options["mesh"] = jax.make_mesh((8,), ("data",))
    fun, dead_weights = _closure()
    made = make(fun, **options)
    out = made(jnp.arange(16.0))
    again = make(fun, **options)(jnp.arange(16.0))  # the same function: its programs shared
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))
    dead_fun = weakref.ref(fun)
    del fun, made, out, again
    jax.clear_caches()  # JAX's own caches keep the constants of what they traced
    gc.collect()
    assert dead_fun() is None
    assert dead_weights() is None
