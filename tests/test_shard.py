"""Placement by `filter_shard` / `filter_replicate`: every target form, eager and in `jit`,
on Auto, Explicit and mixed meshes; moves across device sets; transformations; HLO."""

import contextlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    MESH_KINDS,
    assert_equal_value,
    assert_placed,
    assert_statics_same,
    assert_tree_values,
    make_mesh,
    make_model,
    mesh_on,
    named,
    tree_data,
)
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from eqxshard import filter_replicate, filter_shard

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:2])
MODES = ("eager", "jit")


def run(mode, fn, *args):
    """`fn(*args)` eagerly, or under `eqx.filter_jit` (results read back from the outputs)."""
    if mode == "eager":
        return fn(*args)
    return eqx.filter_jit(fn)(*args)


def replicated_on(tree, mesh):
    """Array leaves committed to `mesh`, replicated: an input already in `jit`'s device set."""
    return jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P())) if eqx.is_array(x) else x, tree
    )


def array_items(tree):
    """(path, leaf) for each array leaf."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [(p, x) for p, x in leaves if eqx.is_array(x)]


# form name -> (call, spec every array leaf ends up with, uses the ambient mesh)
FORMS = {
    "mesh": (lambda t, mesh: filter_shard(t, mesh), P(), False),
    "mesh_spec": (lambda t, mesh: filter_shard(t, mesh, P("data")), P("data"), False),
    "named_sharding": (
        lambda t, mesh: filter_shard(t, NamedSharding(mesh, P("model"))),
        P("model"),
        False,
    ),
    "ambient_pspec": (lambda t, mesh: filter_shard(t, P("data")), P("data"), True),
    "ambient_spec": (lambda t, mesh: filter_shard(t, spec=P("model")), P("model"), True),
    "ambient_none": (lambda t, mesh: filter_shard(t), P(), True),
    "replicate": (lambda t, mesh: filter_replicate(t, mesh), P(), False),
    "replicate_ambient": (lambda t, mesh: filter_replicate(t), P(), True),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", MESH_KINDS)
@pytest.mark.parametrize("form", list(FORMS))
def test_target_forms(form, kind, mode):
    call, spec, ambient = FORMS[form]
    mesh = make_mesh(kind)
    # Eagerly from host data (NumPy, uncommitted jax arrays); in `jit` from arrays already
    # on the mesh but replicated, so a sharded result is the constraint's doing.
    tree = tree_data() if mode == "eager" else replicated_on(tree_data(), mesh)
    with jax.set_mesh(mesh) if ambient else contextlib.nullcontext():
        out = run(mode, lambda t: call(t, mesh), tree)
    assert_statics_same(out, tree)
    for (path, x), (_, ref) in zip(array_items(out), array_items(tree), strict=True):
        assert_placed(x, NamedSharding(mesh, spec), ref, where=jax.tree_util.keystr(path))


def _model_shardings(model, mesh):
    return jax.tree.map(
        lambda x: NamedSharding(mesh, P("data")) if eqx.is_array(x) else None, model
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", MESH_KINDS)
def test_model_statics_and_keys(kind, mode):
    mesh = make_mesh(kind)
    model = make_model() if mode == "eager" else replicated_on(make_model(), mesh)
    out = run(mode, lambda m: filter_shard(m, mesh, P("data")), model)
    assert_statics_same(out, model)
    assert out.activation is model.activation and out.name is model.name
    assert out.fn is model.fn and out.count is model.count
    for (_, x), (_, ref) in zip(array_items(out), array_items(model), strict=True):
        assert_placed(x, named(mesh, "data"), ref)
    assert jnp.issubdtype(out.key.dtype, jax.dtypes.prng_key)
    # The placed model still runs, and gives the same numbers.
    np.testing.assert_allclose(out(jnp.ones(8)), model(jnp.ones(8)), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", MESH_KINDS)
def test_prng_keys(kind, mode):
    mesh = make_mesh(kind)
    key = jax.random.key(3)
    keys = jax.random.split(key, 8)
    tree = {"key": key, "keys": keys}
    if mode == "jit":
        tree = replicated_on(tree, mesh)
    out = run(mode, lambda t: filter_shard(t, mesh, {"key": P(), "keys": P("data")}), tree)
    assert_placed(out["key"], named(mesh), key)
    assert_placed(out["keys"], named(mesh, "data"), keys)
    assert jax.random.key_impl(out["keys"]) == jax.random.key_impl(keys)
    # Still usable as keys, with the same streams.
    draw = jax.vmap(lambda k: jax.random.normal(k, (3,)))
    local = jax.device_put(out["keys"], jax.devices()[0])  # jax 0.7 cannot draw from sharded keys
    np.testing.assert_array_equal(draw(local), draw(keys))


@pytest.mark.parametrize("mode", MODES)
def test_device_target(mode):
    device = jax.devices()[5]
    tree = tree_data()
    out = run(mode, lambda t: filter_shard(t, device), tree)
    assert_statics_same(out, tree)
    for (_, x), (_, ref) in zip(array_items(out), array_items(tree), strict=True):
        assert_placed(x, SingleDeviceSharding(device), ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", MESH_KINDS)
@pytest.mark.parametrize("how", ["target", "spec"])
def test_prefix_trees_leave_none_alone(how, kind, mode):
    mesh = make_mesh(kind)
    tree = tree_data() if mode == "eager" else replicated_on(tree_data(), mesh)
    if how == "target":
        target = {"a": named(mesh, "data"), "b": None, "c": mesh, "key": named(mesh, "model")}
        call = lambda t: filter_shard(t, target)
    else:
        spec = {"a": P("data"), "b": None, "c": P(), "key": P("model")}
        call = lambda t: filter_shard(t, mesh, spec)
    out = run(mode, call, tree)
    assert_tree_values(out, tree)
    assert_placed(out["a"], named(mesh, "data"))
    assert_placed(out["c"][0], named(mesh))
    assert_placed(out["key"], named(mesh, "model"))
    if mode == "eager":
        assert out["b"][0] is tree["b"][0]  # left alone: the very same (NumPy) object
    else:
        assert_placed(out["b"][0], named(mesh))  # left as it came in


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", MESH_KINDS)
def test_callable_spec(kind, mode):
    mesh = make_mesh(kind)
    tree = tree_data() if mode == "eager" else replicated_on(tree_data(), mesh)
    seen = []

    def spec(path, leaf):
        seen.append(jax.tree_util.keystr(path))
        assert eqx.is_array(leaf)
        return P("data", "model") if leaf.ndim == 2 else None

    out = run(mode, lambda t: filter_shard(t, mesh, spec), tree)
    assert sorted(seen) == sorted(jax.tree_util.keystr(p) for p, _ in array_items(tree))
    assert_tree_values(out, tree)
    assert_placed(out["a"], named(mesh, "data", "model"))
    assert_placed(out["b"][0], named(mesh, "data", "model"))
    if mode == "eager":  # 1-D leaves: `None`, left alone
        assert out["c"][0] is tree["c"][0] and out["key"] is tree["key"]


# ----------------------------------------------------------------------------- outside jit


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_eager_inputs_of_every_kind(kind):
    mesh = make_mesh(kind)
    host = np.arange(16, dtype=np.float32).reshape(8, 2)  # float64 would become float32
    tree = {
        "numpy": host,
        "numpy_scalar": np.float32(2.5),
        "uncommitted": jnp.arange(8),
        "committed": jax.device_put(jnp.arange(8.0), jax.devices()[3]),
        "other_layout": jax.device_put(host, named(mesh, None, "model")),
    }
    assert not tree["uncommitted"].committed
    out = filter_shard(tree, mesh, {**{k: P("data") for k in tree}, "numpy_scalar": P()})
    assert_placed(out["numpy"], named(mesh, "data"), host)
    assert_placed(out["numpy_scalar"], named(mesh), np.asarray(np.float32(2.5)))
    for name in ("uncommitted", "committed", "other_layout"):
        assert_placed(out[name], named(mesh, "data"), tree[name])


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_committed_moves_to_another_device_set(kind):
    devices = jax.devices()
    x = jax.device_put(jnp.arange(16.0).reshape(8, 2), devices[0])
    far = mesh_on(kind, devices[4:8])
    out = filter_shard(x, far, P("data"))
    assert_placed(out, named(far, "data"), x)
    # and from a mesh to another mesh on a disjoint device set
    near = mesh_on(kind, devices[0:4])
    y = filter_shard(x, near, P("data"))
    assert_placed(y, named(near, "data"), x)
    z = filter_shard(y, far, P(None, None))
    assert_placed(z, named(far), x)
    assert z.sharding.device_set.isdisjoint(y.sharding.device_set)


@pytest.fixture
def device_put_calls(monkeypatch):
    calls = []
    real = jax.device_put

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(jax, "device_put", counting)
    return calls


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_one_batched_transfer_and_no_copy_when_placed(kind, device_put_calls):
    mesh = make_mesh(kind)
    tree = tree_data()
    placed = filter_shard(tree, mesh, P("data"))
    assert len(device_put_calls) == 1  # all four array leaves in one batched call
    assert len(device_put_calls[0][0]) == 4
    again = filter_shard(placed, mesh, P("data"))
    assert len(device_put_calls) == 1  # nothing moved
    for (_, a), (_, b) in zip(array_items(again), array_items(placed), strict=True):
        assert a is b
    # An equivalent spec, or the NamedSharding itself, is the same layout: still no copy.
    same = filter_shard(placed, {"a": named(mesh, "data", None), "b": None, "c": None, "key": None})
    assert same["a"] is placed["a"]
    assert len(device_put_calls) == 1
    # Only the leaves whose layout changes move, in one call.
    mixed = filter_shard(placed, mesh, {"a": P("model"), "b": P("data"), "c": P(), "key": None})
    assert len(device_put_calls) == 2 and len(device_put_calls[1][0]) == 2
    assert mixed["b"][0] is placed["b"][0] and mixed["key"] is placed["key"]
    assert_placed(mixed["a"], named(mesh, "model"), tree["a"])
    assert_placed(mixed["c"][0], named(mesh), tree["c"][0])


def test_same_devices_other_axis_types_moves():
    """An array on an Auto mesh asked onto an Explicit mesh of the same devices gets the
    Explicit mesh (its type decides how it behaves in `jit`), even with the same spec."""
    auto, explicit = make_mesh("auto"), make_mesh("explicit")
    x = filter_shard(jnp.arange(16.0).reshape(8, 2), auto, P("data"))
    y = filter_shard(x, explicit, P("data"))
    assert y is not x
    assert_placed(y, named(explicit, "data"), x)
    assert isinstance(y.sharding, NamedSharding)
    assert tuple(y.sharding.mesh.axis_types) == tuple(explicit.axis_types)


# ------------------------------------------------------------------------------ inside jit


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_jit_from_uncommitted_inputs(kind):
    mesh = make_mesh(kind)
    tree = tree_data()
    out = eqx.filter_jit(lambda t: filter_shard(t, mesh, P("data", "model")))(
        {"a": tree["a"], "b": tree["b"]}
    )
    assert_placed(out["a"], named(mesh, "data", "model"), tree["a"])
    assert_placed(out["b"][0], named(mesh, "data", "model"), tree["b"][0])
    assert out["b"][1] is tree["b"][1]


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_jit_traces_once(kind):
    mesh = make_mesh(kind)
    traces = []

    @eqx.filter_jit
    def step(model, x):
        traces.append(None)
        model = filter_shard(model, mesh, P("data"))
        x = filter_shard(x, mesh, P(None, "model"))
        return jax.vmap(model)(x).sum(), model

    model = filter_shard(make_model(), mesh, P("data"))
    for i in range(3):
        x = filter_shard(jnp.full((4, 8), float(i)), mesh, P(None, "model"))
        loss, out = step(model, x)
        assert_placed(out.linear.weight, named(mesh, "data"), model.linear.weight)
    assert len(traces) == 1


def test_unconstrained_on_auto_axes():
    mesh = make_mesh("auto")
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), named(mesh, None, "model"))
    spec = P("data", P.UNCONSTRAINED)

    def ours(x):
        return filter_shard(x, mesh, spec)

    def by_hand(x):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    out = jax.jit(ours)(x)
    assert out.sharding.spec[0] == "data"
    assert_equal_value(out, x)
    assert _hlo(ours, x) == _hlo(by_hand, x)


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_inside_shard_map_manual_axes_dropped(kind):
    mesh = make_mesh(kind)
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), named(mesh, "data"))

    def body(block):  # a (2, 8) block per device; 'data' is Manual here
        return filter_shard({"x": block, "s": "static"}, mesh, P("data"))["x"] + 1

    f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    for out in (jax.jit(f)(x), f(x)):
        assert_equal_value(out, x + 1)
        assert_placed(out, named(mesh, "data"))


@pytest.mark.skipif(
    JAX_VERSION < (0, 8),
    reason="jax 0.7 cannot lower with_sharding_constraint inside a partly manual shard_map "
    "('Unhandled OpSharding type'); reproduced with plain JAX",
)
@pytest.mark.parametrize("kind", MESH_KINDS)
def test_inside_partly_manual_shard_map(kind):
    mesh = make_mesh(kind)
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), named(mesh, "data"))

    def body(block):  # Manual 'data', free 'model': the 'model' part of the spec holds
        return filter_shard(block, mesh, P("data", "model")) * 2

    f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), axis_names={"data"})
    out = jax.jit(f)(x)
    assert_equal_value(out, x * 2)
    assert_placed(out, named(mesh, "data", "model"))


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_under_vmap_without_jit(kind, request):
    if kind == "mixed" and JAX_VERSION < (0, 8):
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                reason="jax 0.7: with_sharding_constraint under eager vmap on a mixed mesh "
                "drops the Explicit axes' sharding (plain JAX does the same)",
            )
        )
    mesh = make_mesh(kind)
    xs = jax.device_put(jnp.arange(64.0).reshape(8, 8), named(mesh))
    out = jax.vmap(lambda x: filter_shard({"x": x, "n": 3}, mesh, P("data"))["x"] * 2)(xs)
    assert_equal_value(out, xs * 2)
    # The spec applies to each example: the batch dim stays whole.
    assert_placed(out, named(mesh, None, "data"))


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_under_grad_without_jit(kind, request):
    if kind == "mixed" and JAX_VERSION >= (0, 8):
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                reason="jax >= 0.8: eager grad through reshard + with_sharding_constraint on a "
                "mixed mesh fails 'Expected cotangent type' (plain JAX does the same; fine in jit)",
            )
        )
    mesh = make_mesh(kind)
    x = jax.device_put(jnp.arange(16.0).reshape(8, 2), named(mesh))

    def loss(x):
        y = filter_shard(x, mesh, P("data"))
        return (y * y).sum()

    # Explicit axes under eager `grad` need the mesh in context (a JAX rule: plain
    # `jax.sharding.reshard` says "enter your jit into a mesh context via jax.set_mesh").
    with jax.set_mesh(mesh) if kind != "auto" else contextlib.nullcontext():
        grad = jax.grad(loss)(x)
        value = loss(x)
    np.testing.assert_array_equal(grad, 2 * np.asarray(x))
    assert float(value) == float((np.asarray(x) ** 2).sum())


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_eval_shape(kind):
    mesh = make_mesh(kind)
    tree = tree_data()
    arrays, statics = eqx.partition(tree, eqx.is_array)
    shard = lambda a: eqx.filter(
        filter_shard(eqx.combine(a, statics), mesh, P("data")), eqx.is_array
    )
    out = eqx.combine(jax.eval_shape(shard, arrays), statics)
    assert_statics_same(out, tree)
    assert_statics_same(
        eqx.filter_eval_shape(lambda t: filter_shard(t, mesh, P("data")), tree), tree
    )
    leaves = jax.tree_util.tree_leaves(out)
    for s, ref in zip(leaves, jax.tree_util.tree_leaves(tree), strict=True):
        if not eqx.is_array(ref):
            continue
        assert isinstance(s, jax.ShapeDtypeStruct)
        assert s.shape == ref.shape and s.dtype == ref.dtype
    if kind == "explicit":  # Explicit axes are part of the type: eval_shape sees them
        assert tuple(out["a"].sharding.spec)[:1] == ("data",)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", MESH_KINDS)
def test_replicate_undoes_a_sharding(kind, mode):
    mesh = make_mesh(kind)
    tree = filter_shard(tree_data(), mesh, P("data"))
    out = run(mode, filter_replicate, tree, mesh)
    assert_tree_values(out, tree)
    for _, x in array_items(out):
        assert_placed(x, named(mesh))
    with jax.set_mesh(mesh):
        out = run(mode, filter_replicate, tree)
    for _, x in array_items(out):
        assert_placed(x, named(mesh))


# ---------------------------------------------------------- drop-in for eqx.filter_shard


def _dropin_targets(mesh, mode):
    # Inside `jit` every array is on one device set; outside, leaves may go anywhere.
    elsewhere = (
        SingleDeviceSharding(jax.devices()[1]) if mode == "eager" else NamedSharding(mesh, P())
    )
    return {
        "device": jax.devices()[2],
        "sharding": NamedSharding(mesh, P("data")),
        "prefix_of_shardings": {
            "a": NamedSharding(mesh, P("data", "model")),
            "b": [NamedSharding(mesh, P()), None],
            "c": NamedSharding(mesh, P("model")),
            "key": elsewhere,
        },
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", ["device", "sharding", "prefix_of_shardings"])
def test_drop_in_for_eqx_filter_shard(which, mode):
    mesh = make_mesh("auto")
    target = _dropin_targets(mesh, mode)[which]
    tree = tree_data()
    theirs = run(mode, lambda t: eqx.filter_shard(t, target), tree)
    ours = run(mode, lambda t: filter_shard(t, target), tree)
    assert_statics_same(ours, tree)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for (path, a), (_, b) in zip(array_items(ours), array_items(theirs), strict=True):
        assert_placed(a, b.sharding, b, committed=b.committed, where=jax.tree_util.keystr(path))


@pytest.mark.parametrize("mode", MODES)
def test_drop_in_with_a_sharding_at_every_leaf(mode):
    # Equinox code often builds the shardings with `jax.tree.map(lambda _: s, model)`, which
    # puts a sharding on non-array leaves too; `eqx.filter_shard` ignores those, and so do we.
    mesh = make_mesh("auto")
    model = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0))
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), model)
    theirs = run(mode, lambda m: eqx.filter_shard(m, shardings), model)
    ours = run(mode, lambda m: filter_shard(m, shardings), model)
    assert ours.activation is model.activation
    for (path, a), (_, b) in zip(array_items(ours), array_items(theirs), strict=True):
        assert_placed(a, b.sharding, b, committed=b.committed, where=jax.tree_util.keystr(path))


# ---------------------------------------------------------------------------------- HLO


def _hlo(fn, *args):
    text = jax.jit(fn).lower(*args).as_text()
    text = re.sub(r"@jit_\w+", "@jit_f", text)  # the module is named after the function
    return re.sub(r"loc\([^)]*\)", "", text)


@pytest.mark.parametrize("layout", ["host", "replicated", "other"])
@pytest.mark.parametrize("spec", [P(), P("data"), P("data", "model"), P(None, ("model", "data"))])
def test_hlo_matches_with_sharding_constraint(spec, layout):
    mesh = make_mesh("auto")
    x = jnp.arange(64.0).reshape(8, 8)
    if layout == "replicated":
        x = jax.device_put(x, named(mesh))
    elif layout == "other":
        x = jax.device_put(x, named(mesh, "model", "data"))

    def ours(x):
        return filter_shard(x, mesh, spec)

    def by_hand(x):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    assert _hlo(ours, x) == _hlo(by_hand, x)
    assert "sharding" in _hlo(ours, x)  # the constraint is there (not an identity)


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_under_grad_in_jit(kind):
    mesh = make_mesh(kind)
    x = jax.device_put(jnp.arange(16.0).reshape(8, 2), named(mesh))

    def loss(x):
        y = filter_shard(x, mesh, P("data", "model"))
        return (y * y).sum()

    grad = jax.jit(jax.grad(loss))(x)
    np.testing.assert_array_equal(grad, 2 * np.asarray(x))


@pytest.mark.parametrize("spec", [P("data", "model"), P(("data", "model"), None)])
def test_mixed_mesh_both_halves_hold(spec):
    """On a mixed mesh the Explicit part is a reshard and the Auto part a constraint."""
    mesh = make_mesh("mixed")
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), named(mesh))
    out = jax.jit(lambda x: filter_shard(x, mesh, spec))(x)
    assert_placed(out, NamedSharding(mesh, spec), x)
    hlo = jax.jit(lambda x: filter_shard(x, mesh, spec)).lower(x).as_text()
    expected = '[{"data"}, {"model"}]' if spec == P("data", "model") else '[{"data", "model"}, {}]'
    assert expected in hlo
