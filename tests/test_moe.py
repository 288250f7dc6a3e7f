"""`eqxshard.moe` against the dense sum on one device, written here in plain JAX: values
and gradients (experts, `x`, `weights`) for top-1 and top-2, 8 and 16 experts, on
`(expert=4)`, `(expert=8)` and `(data=2, expert=4)`, Auto and Explicit; GShard's capacity
(what is dropped, and the values without it); the compiled program (all-to-all, never an
all-gather of the experts); every bad input's error."""

from __future__ import annotations

import functools
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import eqxshard

D, HIDDEN, N = 8, 16, 64
MESHES = {
    "expert=4": ((4,), ("expert",)),
    "expert=8": ((8,), ("expert",)),
    "data=2,expert=4": ((2, 4), ("data", "expert")),
}


def per_token(block, h):
    return jax.vmap(block)(h)


def mesh_of(name: str, explicit: bool = False):
    shape, names = MESHES[name]
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def make_experts(e: int):
    keys = jax.random.split(jax.random.key(e), e)
    return eqx.filter_vmap(lambda k: eqx.nn.MLP(D, D, HIDDEN, 1, key=k))(keys)


def route(e: int, k: int, *, skew: float = 0.0):
    """Tokens and a router's top-`k` choices; `skew` pushes tokens toward expert 0."""
    x = jax.random.normal(jax.random.key(1), (N, D))
    logits = jax.random.normal(jax.random.key(2), (N, e)) + skew * (jnp.arange(e) == 0)
    weights, indices = jax.lax.top_k(jax.nn.softmax(logits), k)
    return x, indices, weights


def keep_mask(indices, chunks: int, e: int, capacity: int | None) -> np.ndarray:
    """GShard's rule, as a loop: in each device's chunk of tokens, an expert takes its
    first `capacity` assignments in order of tokens, then of choices."""
    indices = np.asarray(indices)
    keep = np.ones(indices.shape, bool)
    if capacity is None:
        return keep
    for chunk in np.split(np.arange(len(indices)), chunks):
        taken = [0] * e
        for n in chunk:
            for j, i in enumerate(indices[n]):
                keep[n, j] = taken[i] < capacity
                taken[i] += 1
    return keep


def dense(experts, x, indices, weights, keep=None):
    """The reference: every expert on every token, on one device, then the sum."""
    params, static = eqx.partition(experts, eqx.is_array)
    every = jax.vmap(lambda p: per_token(eqx.combine(p, static), x))(params)  # (E, N, D)
    picked = every[indices, jnp.arange(len(x))[:, None]]  # (N, k, D)
    if keep is not None:
        weights = jnp.where(keep, weights, 0.0)
    return jnp.einsum("nk,nkd->nd", weights, picked)


def loss_of(fn, static, indices):
    return lambda params, x, w: jnp.sum(fn(eqx.combine(params, static), x, indices, w) ** 2)


@functools.cache
def case(e: int, k: int):
    """The experts, tokens, choices, dense values and dense gradients of `(E, k)`, made
    once, under `jit` (eagerly the nested `vmap`s run op by op)."""
    experts = eqx.filter_jit(make_experts)(e)
    params, static = eqx.partition(experts, eqx.is_array)
    x, indices, weights = route(e, k)
    y = eqx.filter_jit(dense)(experts, x, indices, weights)
    grads = jax.jit(jax.grad(loss_of(dense, static, indices), argnums=(0, 1, 2)))(
        params, x, weights
    )
    return experts, x, indices, weights, y, grads


def _close(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-5, atol=2e-5)


ALL = [(m, e, k, ex) for m in MESHES for e in (8, 16) for k in (1, 2) for ex in (False, True)]
FAST = {("expert=4", 8, 2, False), ("data=2,expert=4", 16, 1, False), ("expert=8", 8, 2, True)}


@pytest.mark.parametrize(
    "mesh_name,e,k,explicit",
    [p if p in FAST else pytest.param(*p, marks=pytest.mark.heavy) for p in ALL],
)
def test_values_and_gradients_equal_the_dense_sum(mesh_name, e, k, explicit):
    experts, x, indices, weights, y_ref, grads_ref = case(e, k)
    mesh = mesh_of(mesh_name, explicit)
    params, static = eqx.partition(experts, eqx.is_array)

    def fn(ex, x, i, w):
        return eqxshard.moe(per_token, ex, x, i, w, mesh=mesh)

    with jax.set_mesh(mesh):
        y = fn(experts, x, indices, weights)  # eagerly
        grads = jax.jit(jax.grad(loss_of(fn, static, indices), argnums=(0, 1, 2)))(
            params, x, weights
        )
    _close(y, y_ref)
    _close(grads, grads_ref)
    # The output keeps the tokens' split over every axis of the mesh.
    assert y.sharding.spec[0] == (mesh.axis_names if len(mesh.axis_names) > 1 else "expert")


def test_under_jit_on_a_mesh_set_by_set_mesh():
    experts, x, indices, weights, y_ref, _ = case(8, 2)
    mesh = mesh_of("data=2,expert=4")
    f = eqx.filter_jit(lambda ex, x, i, w: eqxshard.moe(per_token, ex, x, i, w))
    with jax.set_mesh(mesh):
        _close(f(experts, x, indices, weights), y_ref)


@pytest.mark.parametrize("factor", [1.0, pytest.param(0.5, marks=pytest.mark.heavy)])
def test_capacity_drops_by_gshards_rule(factor):
    e, k = 8, 2
    experts = case(e, k)[0]
    x, indices, weights = route(e, k, skew=4.0)
    mesh = mesh_of("data=2,expert=4")
    chunks = 8
    capacity = math.ceil(factor * (N // chunks) * k / e)
    keep = keep_mask(indices, chunks, e, capacity)
    assert (~keep).sum() > 0  # the skewed router overflows expert 0
    y, dropped = eqxshard.moe(
        per_token,
        experts,
        x,
        indices,
        weights,
        mesh=mesh,
        capacity_factor=factor,
        return_dropped=True,
    )
    assert int(dropped) == int((~keep).sum())
    _close(y, dense(experts, x, indices, weights, keep))


def test_dropless_drops_nothing_on_a_skewed_router():
    experts = case(8, 2)[0]
    x, indices, weights = route(8, 2, skew=4.0)
    mesh = mesh_of("expert=4")
    y, dropped = eqxshard.moe(
        per_token, experts, x, indices, weights, mesh=mesh, return_dropped=True
    )
    assert int(dropped) == 0
    _close(y, dense(experts, x, indices, weights))


def test_the_program_moves_tokens_not_experts():
    experts, x, indices, weights, *_ = case(8, 2)
    mesh = mesh_of("data=2,expert=4")
    params, static = eqx.partition(experts, eqx.is_array)

    def fn(ex, x, i, w):
        return eqxshard.moe(per_token, ex, x, i, w, mesh=mesh)

    step = jax.jit(jax.value_and_grad(loss_of(fn, static, indices), argnums=(0, 1, 2)))
    text = step.lower(params, x, weights).compile().as_text() or ""
    assert "all-to-all(" in text
    # The experts never move: no all-gather at all, and every collective's operands are
    # one device's share (the expert weights' gradients are summed over 'data' as
    # (E/A=2, ...) blocks); a gathered expert stack would show as (8, 16, 8) or (8, 8, 16).
    assert "all-gather" not in text
    collectives = [
        line for line in text.splitlines() if re.search(r"= .*(all-reduce|all-to-all)\(", line)
    ]
    assert collectives
    assert not [c for c in collectives if re.search(r"f32\[8,(16,8|8,16)\]", c)], collectives


def test_an_eager_call_reuses_its_program():
    from eqxshard import _caches
    from eqxshard._experts import moe as moe_module

    experts, x, indices, weights, y_ref, _ = case(8, 1)
    mesh = mesh_of("expert=4")
    eqxshard.moe(per_token, experts, x, indices, weights, mesh=mesh)
    before = len(moe_module._PROGRAMS)  # noqa: SLF001 - the cache under test
    y = eqxshard.moe(per_token, experts, x + 0, indices, weights, mesh=mesh)
    assert len(moe_module._PROGRAMS) == before  # noqa: SLF001
    _close(y, y_ref)
    _caches.clear_all()  # what `eqxshard.clear_caches` runs
    assert not moe_module._PROGRAMS  # noqa: SLF001


# Bad input: each a clear error, before anything runs.


@pytest.fixture(scope="module")
def small():
    experts = case(8, 2)[0]
    x, indices, weights = route(8, 2)
    return experts, x, indices, weights


def _call(small, **changes):
    experts, x, indices, weights = small
    args = {"experts": experts, "x": x, "indices": indices, "weights": weights}
    args.update(changes)
    options = {
        k: args.pop(k) for k in ("mesh", "axis", "capacity_factor", "data_axes") if k in args
    }
    options.setdefault("mesh", mesh_of("expert=4"))
    return eqxshard.moe(per_token, *args.values(), **options)


def test_experts_not_divisible_by_the_axis(small):
    with pytest.raises(ValueError, match=r"8 experts .* axis 'expert' of size 3"):
        _call(small, mesh=jax.make_mesh((3,), ("expert",), axis_types=(AxisType.Auto,)))


def test_indices_and_weights_not_n_by_k(small):
    _, x, indices, weights = small
    with pytest.raises(ValueError, match=r"`indices` of shape \(N, k\) = \(64, k\)"):
        _call(small, indices=indices[:10])
    with pytest.raises(ValueError, match=r"`weights` of shape \(N, k\)"):
        _call(small, weights=weights[:, 0])
    with pytest.raises(ValueError, match=r"`indices` and `weights` of one shape"):
        _call(small, weights=weights[:, :1])
    with pytest.raises(ValueError, match=r"`x` as tokens of shape \(N, D\)"):
        _call(small, x=x[None])


def test_an_axis_the_mesh_lacks(small):
    with pytest.raises(ValueError, match=r"`axis='experts'`, which the mesh lacks"):
        _call(small, axis="experts")
    with pytest.raises(ValueError, match=r"`data_axes=\('data',\)`, but \['data'\] are not"):
        _call(small, data_axes=("data",))


def test_non_integer_indices(small):
    _, _, indices, _ = small
    with pytest.raises(TypeError, match=r"`indices` as integers .* float32"):
        _call(small, indices=indices.astype(jnp.float32))


def test_experts_that_disagree_on_e(small):
    experts = small[0]
    bad = eqx.tree_at(lambda m: m.layers[0].bias, experts, jnp.zeros((4, HIDDEN)))
    with pytest.raises(ValueError, match=r"same leading \(expert\) dim; most have 8(.|\n)*bias"):
        _call(small, experts=bad)


def test_no_mesh(small):
    with pytest.raises(ValueError, match=r"no `mesh` and no mesh is set"):
        _call(small, mesh=None)


def test_tokens_not_divisible_and_a_bad_capacity(small):
    _, x, indices, weights = small
    with pytest.raises(ValueError, match=r"63 tokens .* not divisible by 4"):
        _call(small, x=x[:63], indices=indices[:63], weights=weights[:63])
    with pytest.raises(ValueError, match=r"`capacity_factor` as a number > 0"):
        _call(small, capacity_factor=0)


def test_a_model_axis_inside_the_experts_stays_with_the_compiler():
    # `data_axes=()`: the tokens split over 'expert' only; 'model' splits each expert's
    # hidden dim (Megatron-style), which the compiler keeps: an all-reduce over 'model'
    # joins the two halves, and nothing is gathered.
    experts, x, indices, weights, y_ref, _ = case(8, 2)
    mesh = jax.make_mesh((4, 2), ("expert", "model"), axis_types=(AxisType.Auto,) * 2)
    rule = eqxshard.path_rules(
        [
            (r"layers\.0\.weight", P("expert", "model", None)),
            (r"layers\.0\.bias", P("expert", "model")),
            (r".*", P("expert")),
        ]
    )
    params, static = eqx.partition(eqxshard.filter_shard(experts, mesh, rule), eqx.is_array)

    @jax.jit
    def f(params, x, w):
        return eqxshard.moe(
            per_token, eqx.combine(params, static), x, indices, w, mesh=mesh, data_axes=()
        )

    _close(f(params, x, weights), y_ref)
    text = f.lower(params, x, weights).compile().as_text() or ""
    assert "all-gather" not in text and "all-to-all(" in text and "all-reduce(" in text


def test_fsdp_within_each_experts_weights():
    # (fsdp=2, expert=4): each expert's weights also split over 'fsdp' on their largest
    # dim (`experts(inner=fsdp(...))`), the tokens over both axes. Each device gathers its
    # own 2 experts' halves from its 'fsdp' partner, never another device's experts.
    experts, x, indices, weights, y_ref, grads_ref = case(8, 2)
    mesh = jax.make_mesh((2, 4), ("fsdp", "expert"), axis_types=(AxisType.Auto,) * 2)
    rule = eqxshard.experts("expert", inner=eqxshard.fsdp("fsdp", min_size=0))
    layer = eqxshard.filter_shard(eqxshard.Experts(experts, mesh=mesh), mesh, rule)
    blocks = layer.expert_blocks
    assert blocks.layers[0].weight.sharding.spec == P("expert", "fsdp")
    assert blocks.layers[1].weight.sharding.spec == P("expert", None, "fsdp")
    assert blocks.layers[1].bias.sharding.spec == P("expert", "fsdp")
    assert "P('expert', None, 'fsdp')" in str(eqxshard.describe(layer, mesh, rule))
    params, static = eqx.partition(blocks, eqx.is_array)

    def fn(ex, x, i, w):
        return eqxshard.moe(per_token, ex, x, i, w, mesh=mesh)

    _close(fn(blocks, x, indices, weights), y_ref)
    step = jax.jit(jax.value_and_grad(loss_of(fn, static, indices), argnums=(0, 1, 2)))
    _close(step(params, x, weights)[1], grads_ref)
    text = step.lower(params, x, weights).compile().as_text() or ""
    assert "all-to-all(" in text
    gathers = [line for line in text.splitlines() if re.search(r"= .*all-gather(-start)?\(", line)]
    assert gathers  # the 'fsdp' halves
    for line in gathers:
        # Each gathers one device's 2 experts (leading dim 2 = E/A), between the two
        # devices of an 'fsdp' pair: device d with d + 4 (groups [4,2] of the transposed
        # (2, 4) mesh), never along 'expert'.
        assert re.search(r"= f32\[2,", line), line
        assert "replica_groups=[4,2]<=[2,4]T(1,0)" in line or "{0,4}" in line, line
    collectives = re.findall(r"= (.*?)(?:all-reduce|all-to-all|all-gather)", text)
    assert not [c for c in collectives if re.search(r"f32\[8,(16,8|8,16)\]", c)]
