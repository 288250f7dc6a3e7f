"""Optimiser state laid out like the parameters it mirrors (`like(params)`), for every
optax transform people use, on Auto and Explicit meshes, eagerly and inside `jit`.

The expected layout of each state leaf is written out here from optax's own state
structure (its paths and shapes), not from `like`'s code."""

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqxshard

filter_jit = eqxshard.filter_jit

SPECS = {"w": P("data", "model"), "b": P("data"), "sq": P("model", "data")}
# adafactor (factored above 8 elements per dim): `v_row` lacks the parameter's largest
# dim, `v_col` its second largest; on the square `sq`, argsort order makes `v_row` lack
# dim 1 and `v_col` dim 0.
FACTORED = {
    ("v_row", "w"): P("model"),
    ("v_col", "w"): P("data"),
    ("v_row", "sq"): P("model"),
    ("v_col", "sq"): P("data"),
}

OPTIMISERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2),
    "lion": lambda: optax.lion(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    "masked": lambda: optax.masked(optax.adam(1e-2), {"w": True, "b": False, "sq": True}),
    "multi_transform": lambda: optax.multi_transform(
        {"a": optax.adam(1e-2), "s": optax.sgd(1e-2, momentum=0.9)},
        {"w": "a", "b": "s", "sq": "a"},
    ),
    "MultiSteps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "schedule": lambda: optax.adam(optax.linear_schedule(1e-2, 0.0, 10)),
    "lookahead": lambda: optax.lookahead(optax.adam(1e-2), 2, 0.5),
}


def _expected(path, leaf):
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    last = keys[-1]
    if last in ("w", "b", "sq"):
        for field in ("v_row", "v_col"):
            if field in keys:
                return FACTORED.get((field, last), P())
        if leaf.shape == SHAPES[last]:
            return SPECS[last]
    return P()


SHAPES = {"w": (16, 8), "b": (16,), "sq": (8, 8)}


def _params(mesh):
    key = jax.random.key(0)
    raw = {
        k: jax.random.normal(jax.random.fold_in(key, i), s)
        for i, (k, s) in enumerate(SHAPES.items())
    }
    return raw, eqxshard.filter_shard(raw, {k: NamedSharding(mesh, SPECS[k]) for k in raw})


def _check(state, mesh):
    for path, leaf in jtu.tree_flatten_with_path(state)[0]:
        want = NamedSharding(mesh, _expected(path, leaf))
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (jtu.keystr(path), leaf.sharding)


# Auto axes compile each case once more: CI runs them once (heavy), Explicit every time.
@pytest.mark.parametrize(
    "axis_type", [AxisType.Explicit, pytest.param(AxisType.Auto, marks=pytest.mark.heavy)]
)
@pytest.mark.parametrize("name", list(OPTIMISERS))
def test_state_like_params(name, axis_type):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    optimiser = OPTIMISERS[name]()
    raw, params = _params(mesh)
    if name == "lookahead":
        raw = optax.LookaheadParams.init_synced(raw)
        params = optax.LookaheadParams.init_synced(params)
    rule = eqxshard.like(params)
    # Eagerly: created directly in its layout, and an existing state laid out.
    state = eqxshard.filter_init(optimiser.init, mesh, rule)(params)
    _check(state, mesh)
    _check(eqxshard.filter_shard(optimiser.init(raw), mesh, rule), mesh)

    # Inside `jit`: one update, the new state pinned by `out_shardings`.
    def step(params, state, grads):
        updates, state = optimiser.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    fast = lambda p: p.fast if name == "lookahead" else p  # lookahead's grads: of `fast`
    grads = jtu.tree_map(lambda p: p * 0.1, fast(params))
    jitted = filter_jit(step, out_shardings=(None, rule), mesh=mesh)
    new_params, new_state = jitted(params, state, grads)
    _check(new_state, mesh)
    # The same values as the update on one device.
    want_params, want_state = jax.jit(step)(
        raw, optimiser.init(raw), jtu.tree_map(lambda p: p * 0.1, fast(raw))
    )
    for a, b in zip(
        jtu.tree_leaves((new_params, new_state)),
        jtu.tree_leaves((want_params, want_state)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # `like` as a layout constraint inside a plain `jax.jit`.
    inside = jax.jit(lambda s: eqxshard.filter_shard(s, mesh, rule))(optimiser.init(raw))
    _check(inside, mesh)


def test_big_leaf_mirroring_nothing_is_an_error():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    _, params = _params(mesh)
    state = {"extra": jnp.zeros((64, 64)), "small": jnp.zeros((4, 4)), "mu": params}
    with pytest.raises(ValueError, match=r"\n  extra  shape \(64, 64\)  mirrors no parameter"):
        eqxshard.filter_shard(state, mesh, eqxshard.like(params, min_size=1024))
    out = eqxshard.filter_shard(state, mesh, eqxshard.like(params, min_size=64 * 64 + 1))
    assert out["extra"].sharding.is_fully_replicated
    with pytest.raises(TypeError, match="`min_size` as an int"):
        eqxshard.like(params, min_size=-1)


def test_describe_shows_optimiser_bytes():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    _, params = _params(mesh)
    state = eqxshard.filter_init(optax.adam(1e-2).init, mesh, eqxshard.like(params))(params)
    table = eqxshard.describe({"params": params, "opt_state": state})
    # Per device: w 16x8 / 8 devices, b 16 / 4, sq 8x8 / 8, in float32; adam holds two
    # moments of each, and a replicated int32 counter.
    param_bytes = (16 * 8 // 8 + 16 // 4 + 8 * 8 // 8) * 4
    assert table.parts == {"params": param_bytes, "opt_state": 2 * param_bytes + 4}
    assert "by part: opt_state: 228 B, params: 112 B." in str(table)
    assert eqxshard.describe(params).parts == {"w": 64, "b": 16, "sq": 32}
    assert eqxshard.describe(params["w"]).parts == {}
