"""`filter_jacfwd`/`filter_jacrev`/`filter_hessian`: equal to Equinox and JAX at every
`batch_size`, memory bounded by the chunk, sharded without collectives, auto budgets."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import eqxshard

JACS = {
    "rev": (eqxshard.filter_jacrev, eqx.filter_jacrev, jax.jacrev),
    "fwd": (eqxshard.filter_jacfwd, eqx.filter_jacfwd, jax.jacfwd),
}


def _close(a, b):
    assert jtu.tree_structure(a) == jtu.tree_structure(b)
    jtu.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5), a, b)


def _tree_fun(p, x):
    """PyTree in (with a non-array leaf), PyTree out."""
    h = jnp.tanh(p["w"] @ x + p["b"]) * p["scale"]
    return {"h": h, "sum": (jnp.sum(p["w"] ** 2), h[:2] * p["b"][:2])}


def _tree_args():
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"w": jax.random.normal(k1, (5, 3)), "b": jax.random.normal(k2, (5,)), "scale": 2}
    return p, jnp.arange(3.0)


def _sizes(rev):
    return 5 + 1 + 2 if rev else 15 + 5  # output size (rev) or input size (fwd)


@pytest.mark.parametrize("mode", ["rev", "fwd"])
@pytest.mark.parametrize("which", ["none", "1", "3", "n-1", "n", "n+1"])
def test_tree_values_equal_equinox_at_every_batch_size(mode, which):
    ours, theirs, _ = JACS[mode]
    n = _sizes(mode == "rev")
    batch_size = {"none": None, "1": 1, "3": 3, "n-1": n - 1, "n": n, "n+1": n + 1}[which]
    p, x = _tree_args()
    got = ours(_tree_fun, batch_size=batch_size)(p, x)
    _close(got, theirs(_tree_fun)(p, x))
    assert got["h"]["scale"] is None  # the non-array leaf is not differentiated
    assert p["scale"] == 2


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_module_with_static_leaves_and_aux_under_jit(mode):
    ours, theirs, _ = JACS[mode]
    model = eqx.nn.MLP(3, 2, 4, 1, activation=jax.nn.softplus, key=jax.random.key(1))

    def f(m, x):
        y = m(x)
        return y, {"norm": jnp.sum(y**2), "tag": "ok"}

    x = jnp.ones(3)
    # Equinox's forward mode rejects the string in `aux` (as `jax.jacfwd` does); ours keeps it.
    expected, aux = theirs(lambda m, x: (f(m, x)[0], f(m, x)[1]["norm"]), has_aux=True)(model, x)
    aux = {"norm": aux}
    got, got_aux = eqx.filter_jit(ours(f, has_aux=True, batch_size=2))(model, x)
    _close(eqx.filter(got, eqx.is_array), eqx.filter(expected, eqx.is_array))
    assert got_aux["tag"] == "ok"
    np.testing.assert_allclose(got_aux["norm"], aux["norm"], rtol=1e-6)
    # Statics of the module stay as they are (activation function, sizes).
    assert got.activation is None and expected.activation is None  # not differentiated
    assert got.layers[0].in_features == 3  # static fields as they are


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_plain_arrays_equal_jax(mode):
    ours, _, jax_jac = JACS[mode]

    def f(x, y):
        return jnp.cumsum(jnp.sin(x) * y[0])

    x, y = jnp.linspace(0, 1, 7), jnp.ones(2)
    for batch_size in (None, 1, 4, 7):
        _close(ours(f, batch_size=batch_size)(x, y), jax_jac(f)(x, y))


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_batched_jacobians_under_jit_vmap(mode):
    ours, _, jax_jac = JACS[mode]

    def f(lam, u, h0):  # a linear recurrence, as in the seed
        def step(h, ut):
            h = lam * h + ut
            return h, h

        return jax.lax.scan(step, h0, u)[0]

    lam, u, h0 = jnp.full(4, 0.9), jnp.ones((3, 6, 4)), jnp.ones((3, 4))
    expected = jax.vmap(jax_jac(f), (None, 0, 0))(lam, u, h0)
    got = jax.jit(jax.vmap(ours(f, batch_size=3), (None, 0, 0)))(lam, u, h0)
    _close(got, expected)


def test_unchunked_is_the_same_program_as_equinox():
    p, x = _tree_args()
    for ours, theirs, _ in JACS.values():
        a = jax.make_jaxpr(ours(_tree_fun))(p, x)
        b = jax.make_jaxpr(theirs(_tree_fun))(p, x)
        assert str(a) == str(b)


def _temps(fn, *args):
    memory = jax.jit(fn).lower(*args).compile().memory_analysis()
    assert memory is not None  # the CPU backend reports it
    return memory.temp_size_in_bytes


def _auto_cache(jac: Any) -> dict[Hashable, int]:
    """The batch sizes `batch_size="auto"` chose, per input shapes (the verbs' result is typed
    as a plain callable, which has no `auto`)."""
    return jac.auto.cache


_A = jax.random.normal(jax.random.key(0), (64, 4)) / 2


def _wide_in(x):  # (64,) -> (4,); one pass holds 64 x 64 intermediates that do not fuse away
    m = jnp.tanh(jnp.outer(x, x))
    return jnp.tanh(m @ m)[:4].sum(1)


def _wide_out(x):  # (4,) -> (64,)
    z = _A[:, : x.shape[0]] @ x
    m = jnp.tanh(jnp.outer(z, z))
    return jnp.tanh(m @ m).sum(1)


# Each mode with a function of 64 basis vectors whose Jacobian is small next to a pass.
WIDE = {"rev": (_wide_out, jnp.linspace(0, 1, 4)), "fwd": (_wide_in, jnp.linspace(0, 1, 64))}


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_temporaries_shrink_with_batch_size(mode):
    ours = JACS[mode][0]
    f, x = WIDE[mode]
    full, eighth, one = (_temps(ours(f, batch_size=k), x) for k in (None, 8, 1))
    assert one < eighth <= full / 4, (one, eighth, full)
    assert _temps(ours(f, batch_size=64), x) <= full  # one chunk of all: no worse than JAX


def _mesh(kind):
    types = (AxisType.Explicit,) * 2 if kind == "explicit" else (AxisType.Auto,) * 2
    return jax.make_mesh((2, 4), ("a", "b"), axis_types=types)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("mode", ["rev", "fwd"])
@pytest.mark.parametrize("axis", [None, "b"])
def test_sharded_rows_or_columns_without_all_gather(kind, mode, axis):
    ours, _, jax_jac = JACS[mode]
    mesh = _mesh(kind)
    devices = 8 if axis is None else 4

    def f(x):
        return jnp.cumsum(jnp.sin(x)) * 2

    x = jnp.linspace(0, 1, 32)
    jac = jax.jit(ours(f, batch_size=2 * devices, mesh=mesh, axis=axis))
    got = jac(x)
    np.testing.assert_allclose(got, jax_jac(f)(x), rtol=1e-5, atol=1e-6)
    names = ("a", "b") if axis is None else ("b",)
    spec = P(names, None) if mode == "rev" else P(None, names)
    assert got.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), 2)
    hlo = jac.lower(x).compile().as_text()
    assert hlo is not None
    assert "all-gather" not in hlo and "all-to-all" not in hlo


def test_sharded_eager_with_padding_and_tree():
    mesh = _mesh("auto")
    p, x = _tree_args()  # 8 outputs and 20 inputs: 20 is padded to 24 over 8 devices
    _close(eqxshard.filter_jacrev(_tree_fun, mesh=mesh)(p, x), eqx.filter_jacrev(_tree_fun)(p, x))
    _close(eqxshard.filter_jacfwd(_tree_fun, mesh=mesh)(p, x), eqx.filter_jacfwd(_tree_fun)(p, x))


def test_sharded_per_device_temporaries_shrink():
    mesh = _mesh("auto")
    w = jax.random.normal(jax.random.key(0), (64, 64)) / 8

    def f(x):
        for _ in range(4):
            x = jnp.tanh(w @ x)
        return x

    x = jnp.ones((64, 16))
    one_device = _temps(eqxshard.filter_jacrev(f, batch_size=128), x)
    sharded = _temps(eqxshard.filter_jacrev(f, batch_size=128, mesh=mesh), x)
    assert sharded <= one_device / 4, (sharded, one_device)


def _scalar(x):
    return jnp.sum(jnp.sin(x["a"]) ** 2 * x["b"][0]) + jnp.sum(x["b"] ** 3)


@pytest.mark.parametrize("batch_size", [None, 1, 3, 9, 10])
def test_hessian_equals_equinox_and_jax(batch_size):
    x = {"a": jnp.linspace(0, 1, 7), "b": jnp.arange(1.0, 3.0)}
    got = eqxshard.filter_hessian(_scalar, batch_size=batch_size)(x)
    _close(got, eqx.filter_hessian(_scalar)(x))
    _close(got, jax.hessian(_scalar)(x))


def test_hessian_has_aux_and_sharded():
    def f(x):
        return _scalar(x), x["a"][0]

    x = {"a": jnp.linspace(0, 1, 14), "b": jnp.arange(1.0, 3.0)}
    got, aux = jax.jit(eqxshard.filter_hessian(f, has_aux=True, mesh=_mesh("auto")))(x)
    expected, expected_aux = eqx.filter_hessian(f, has_aux=True)(x)
    _close(got, expected)
    np.testing.assert_allclose(aux, expected_aux)


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_auto_picks_the_largest_fitting_batch_size(mode):
    ours = JACS[mode][0]
    f, x = WIDE[mode]
    budget = _temps(ours(f, batch_size=None), x) // 4
    jac = ours(f, batch_size="auto", memory_budget=budget)
    _close(jac(x), JACS[mode][1](f)(x))
    (k,) = _auto_cache(jac).values()
    assert 1 <= k < 64
    assert _temps(ours(f, batch_size=k), x) <= budget
    assert _temps(ours(f, batch_size=k + 1), x) > budget
    jac(x + 1)  # same shapes: no new search
    jax.jit(jac)(x)  # under jit: the same shapes, the same cached answer
    assert len(_auto_cache(jac)) == 1
    jac(x[:2])
    assert len(_auto_cache(jac)) == 2


def test_auto_sharded_picks_a_multiple_of_the_devices():
    mesh = _mesh("auto")
    f, x = WIDE["rev"]
    full = _temps(eqxshard.filter_jacrev(f, mesh=mesh), x)
    jac = eqxshard.filter_jacrev(f, batch_size="auto", memory_budget=full // 3, mesh=mesh)
    np.testing.assert_allclose(jac(x), jax.jacrev(f)(x), rtol=1e-4, atol=1e-5)
    (k,) = _auto_cache(jac).values()
    assert k % 8 == 0 and k < 64
    assert _temps(eqxshard.filter_jacrev(f, batch_size=k, mesh=mesh), x) <= full // 3


def test_auto_errors_name_the_smallest_footprint():
    f, x = WIDE["rev"]
    one = _temps(eqxshard.filter_jacrev(f, batch_size=1), x)
    jac = eqxshard.filter_jacrev(f, batch_size="auto", memory_budget=1000)
    with pytest.raises(ValueError, match=rf"`filter_jacrev\(batch_size=\"auto\"\)`.*{one:,}"):
        jac(x)
    with pytest.raises(ValueError, match="memory_budget"):
        eqxshard.filter_jacfwd(f, batch_size="auto")(x)  # CPU reports no memory size


_W = jax.random.normal(jax.random.key(2), (32, 32)) / 4


def _net(w, x):  # (32, 32) -> (32,): a batch of 16 `x` gives 16 Jacobians of 128 KiB
    for _ in range(2):
        x = jnp.tanh(w @ x)
    return x


def _batched_temps(jac):
    return _temps(jax.vmap(jac, (None, 0)), _W, jnp.ones((16, 32)))


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_batched_chunks_are_written_in_place(mode):
    # Under `vmap` a `lax.scan` would stack the chunks as (chunks, batch, k, ...) and move
    # the batch first: a second copy of the whole batched Jacobian (2 MiB here).
    ours = JACS[mode][0]
    n = 32 if mode == "rev" else 32 * 32
    full, eighth = (_batched_temps(ours(_net, batch_size=k)) for k in (None, n // 8))
    if mode == "rev":  # the Jacobian is the output; a pass is small next to it
        assert eighth <= 16 * 32**3 * 4 / 8, (eighth, full)
    else:
        assert eighth <= full / 4, (eighth, full)


def test_auto_under_vmap_budgets_the_batched_program():
    budget = _batched_temps(eqxshard.filter_jacrev(_net, batch_size=8))
    jac = eqxshard.filter_jacrev(_net, batch_size="auto", memory_budget=budget)
    assert _batched_temps(jac) <= budget  # not one element's temporaries: the batch's
    (k,) = _auto_cache(jac).values()
    assert _batched_temps(eqxshard.filter_jacrev(_net, batch_size=k + 1)) > budget


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_sharded_under_vmap_with_a_remainder(mode):
    ours, _, jax_jac = JACS[mode]

    def f(x):
        return jnp.cumsum(jnp.sin(x)) * 2

    xs = jnp.linspace(0, 1, 3 * 40).reshape(3, 40)  # 40 vectors, 5 per device: 2 + 2 + 1
    got = jax.jit(jax.vmap(ours(f, batch_size=16, mesh=_mesh("auto"))))(xs)
    np.testing.assert_allclose(got, jax.vmap(jax_jac(f))(xs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_no_basis_vectors(mode):
    ours, theirs, _ = JACS[mode]
    f, x = (lambda x: x[:0], jnp.ones(3)) if mode == "rev" else (lambda x: x.sum() * x, jnp.ones(0))
    for batch_size in (None, 1, 2):
        _close(ours(f, batch_size=batch_size)(x), theirs(f)(x))


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_sharded_tree_of_leaves_each_split_along_its_own_dimension(mode):
    # Each basis leaf is cut along its first dimension that 8 divides (dim 1 of `a`), so
    # nothing is gathered, as it was when the flattened basis was cut in 8 across leaves.
    ours, theirs, _ = JACS[mode]
    big = {"a": jnp.linspace(0, 1, 32).reshape(2, 16), "b": jnp.linspace(1, 2, 16)}
    small = jnp.linspace(0, 1, 3)

    def f(x):
        if mode == "rev":  # the basis is the output
            return {"a": jnp.sin(x[0] * big["a"]), "b": jnp.cos(x[1:].sum() * big["b"])}
        return jnp.tanh(x["a"].sum(0) @ x["b"] * small)

    x = small if mode == "rev" else big
    jac = jax.jit(ours(f, batch_size=16, mesh=_mesh("auto")))
    got = jac(x)
    _close(got, theirs(f)(x))
    hlo = jac.lower(x).compile().as_text()
    assert hlo is not None
    assert not any(
        op in hlo for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute")
    )
    a = got["a"]
    axis = 1 if mode == "rev" else 2  # `a`'s dim 1 among the Jacobian's dimensions
    assert a.sharding.shard_shape(a.shape)[axis] == a.shape[axis] // 8
