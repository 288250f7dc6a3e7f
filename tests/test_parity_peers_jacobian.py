"""The chunked Jacobians against `eqx.filter_jac*` on the cases of Equinox's `test_ad.py`
that `test_parity_jacobian.py` does not run: a Module's Jacobian against `filter_grad`,
the Hessian of a two-argument and of a `custom_vjp` function, and inputs and outputs
holding PRNG keys, integers, statics, `None`, namedtuples, keyword arguments and zero-size
arrays. Tree, shapes, dtypes, weak types and values are compared; with `mesh=` the result
is laid out on that mesh (eqxshard's addition), so layouts are compared without it."""

from __future__ import annotations

import collections
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxshard

Pair = collections.namedtuple("Pair", "a b")
VERBS = {
    "fwd": (eqxshard.filter_jacfwd, eqx.filter_jacfwd),
    "rev": (eqxshard.filter_jacrev, eqx.filter_jacrev),
    "hessian": (eqxshard.filter_hessian, eqx.filter_hessian),
}
SETTINGS: dict[str, dict[str, Any]] = {
    "int": {"batch_size": 2},
    "auto": {"batch_size": "auto", "memory_budget": 2**30},
    "mesh": {"mesh": jax.make_mesh((8,), ("basis",))},
}


def _same(got, want, layout=True):
    assert jtu.tree_structure(got) == jtu.tree_structure(want)
    for a, b in zip(jtu.tree_leaves(got), jtu.tree_leaves(want), strict=True):
        if not eqx.is_array(b):
            assert a == b
            continue
        assert (a.shape, a.dtype, a.weak_type) == (b.shape, b.dtype, b.weak_type), (a, b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        if layout:
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)


def _check(verb, setting, fun, *args, **kwargs):
    ours, theirs = VERBS[verb]
    options = {k: v for k, v in SETTINGS[setting].items()}
    has_aux = kwargs.pop("has_aux", False)
    got = ours(fun, has_aux=has_aux, **options)(*args, **kwargs)
    want = theirs(fun, has_aux=has_aux)(*args, **kwargs)
    _same(got, want, layout=setting != "mesh")
    return got


class _Net(eqx.Module):
    layers: list
    extra_bias: jax.Array

    def __call__(self, x):
        return self.layers[1](jax.nn.relu(self.layers[0](x))) + self.extra_bias


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("verb", ["fwd", "rev"])
def test_jacobian_of_a_loss_wrt_a_module_is_its_gradient(verb, setting):
    k1, k2 = jax.random.split(jax.random.key(0))
    net = _Net([eqx.nn.Linear(2, 4, key=k1), eqx.nn.Linear(4, 2, key=k2)], jnp.ones(2))
    x = jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)

    def loss(model, x, y):
        return jnp.mean((y - jax.vmap(model)(x)) ** 2)

    got = _check(verb, setting, loss, net, x, x)
    grad = eqx.filter_grad(loss)(net, x, x)
    for a, b in zip(jtu.tree_leaves(got), jtu.tree_leaves(grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _sin_times(x, y):
    return jnp.sin(x) * y


_custom = jax.custom_vjp(_sin_times)
_custom.defvjp(
    lambda x, y: (_sin_times(x, y), (jnp.cos(x), jnp.sin(x), y)),
    lambda res, g: (res[0] * g * res[2], res[1] * g),
)


@pytest.mark.parametrize("setting", SETTINGS)
def test_hessian_of_two_arguments_and_of_a_custom_vjp(setting):
    x, y = jnp.array(1.0), jnp.array(2.0)
    got = _check("hessian", setting, _sin_times, x, y)
    np.testing.assert_allclose(got, jax.hessian(_sin_times)(1.0, 2.0), rtol=1e-6)
    _check("hessian", setting, _custom, x, y)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("verb", ["fwd", "rev"])
def test_leaves_of_every_kind(verb, setting):
    x = jnp.linspace(0.1, 1.0, 4)
    # PRNG keys, integers and statics in the input are held fixed (with `"auto"`, a key
    # leaf raised JAX's "canonicalize_dtype called on extended dtype").
    tree = {"a": x, "k": jax.random.key(0), "i": jnp.arange(4), "n": 3, "s": "tag", "z": None}
    _check(verb, setting, lambda t: t["a"] * jax.random.normal(t["k"], (4,)) * t["i"], tree)
    _check(verb, setting, lambda t: Pair(t.a * t.b, jnp.sum(t.a)), Pair(x, x))
    _check(verb, setting, lambda x, *, y: x * y, x, y=x)
    _check(verb, setting, lambda x: (x[0], {"k": x[:2] * 2}), x, has_aux=False)
    _check(verb, setting, lambda x: (x * 2, {"norm": jnp.sum(x)}), x, has_aux=True)


@pytest.mark.parametrize("verb", ["fwd", "rev"])
def test_zero_size_inputs_and_outputs(verb):
    for setting in ("int", "auto"):
        _check(verb, setting, lambda x: jnp.sum(x) + 1.0, jnp.zeros((0,)))
        _check(verb, setting, lambda x: x[:0], jnp.linspace(0.1, 1.0, 4))


@pytest.mark.parametrize("setting", [*SETTINGS, "none"])
@pytest.mark.parametrize("verb", ["fwd", "rev", "hessian"])
def test_python_float_input_is_named(verb, setting):
    # Nothing to differentiate: Equinox fails inside JAX ("at least one array or dtype is
    # required", "Too few leaves for PyTreeDef"); reverse mode under `"auto"` raised a bare
    # AttributeError ("'float' object has no attribute 'shape'").
    ours, theirs = VERBS[verb]
    with pytest.raises(ValueError):
        theirs(lambda x: x**3)(2.0)
    with pytest.raises(ValueError, match=r"has none.*\n  <root>  float 2.0"):
        ours(lambda x: x**3, **SETTINGS.get(setting, {}))(2.0)
