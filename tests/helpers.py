"""Shared test helpers: meshes of every axis-type kind, a small model, placement asserts.

Meshes are built with explicit `axis_types=` so that a test means the same on every JAX
version (`jax.make_mesh` defaults to Explicit axes from jax 0.9, to Auto before).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P, Sharding

import eqxshard

if TYPE_CHECKING:
    # `jax.Device` is a name jax assigns at import (`Device = xla_client.Device`), which a type
    # checker cannot use in an annotation; this is the class it names.
    from jaxlib._jax import Device
else:
    Device = jax.Device

SHAPE = (4, 2)
NAMES = ("data", "model")

# JAX's persistent compilation cache (set up in tests/conftest.py): a child process keeps it.
CACHE_SETTINGS = ("JAX_COMPILATION_CACHE_", "JAX_PERSISTENT_CACHE_")


def without_jax_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` less its JAX and XLA settings, for a child process that starts from JAX's
    defaults, but keeping the tests' persistent compilation cache (`CACHE_SETTINGS`)."""
    return {
        k: v
        for k, v in environ.items()
        if k.startswith(CACHE_SETTINGS) or not k.startswith(("JAX_", "XLA_"))
    }


# Axis types per kind, for the ("data", "model") mesh. "mixed": Explicit data, Auto model.
AXIS_TYPES: dict[str, tuple[AxisType, ...]] = {
    "auto": (AxisType.Auto, AxisType.Auto),
    "explicit": (AxisType.Explicit, AxisType.Explicit),
    "mixed": (AxisType.Explicit, AxisType.Auto),
}
MESH_KINDS = tuple(AXIS_TYPES)


def make_mesh(
    kind: str = "auto",
    shape: Sequence[int] = SHAPE,
    names: Sequence[str] = NAMES,
    devices: Sequence[Device] | None = None,
) -> Mesh:
    """A mesh of `shape` named `names`, with the axis types of `kind`.

    `kind` is "auto", "explicit" or "mixed" (the first axis Explicit, the rest Auto).
    `devices` defaults to the first `prod(shape)` devices.
    """
    shape, names = tuple(shape), tuple(names)
    if kind == "auto":
        types = (AxisType.Auto,) * len(shape)
    elif kind == "explicit":
        types = (AxisType.Explicit,) * len(shape)
    elif kind == "mixed":
        types = (AxisType.Explicit,) + (AxisType.Auto,) * (len(shape) - 1)
    else:
        raise ValueError(f"unknown mesh kind {kind!r}")
    if devices is None:
        devices = jax.devices()[: int(np.prod(shape))]
    return jax.make_mesh(shape, names, axis_types=types, devices=list(devices))


def auto_mesh(**kwargs: Any) -> Mesh:
    return make_mesh("auto", **kwargs)


def explicit_mesh(**kwargs: Any) -> Mesh:
    return make_mesh("explicit", **kwargs)


def mixed_mesh(**kwargs: Any) -> Mesh:
    return make_mesh("mixed", **kwargs)


def mesh_on(kind: str, devices: Sequence[Device], names: Sequence[str] = ("data",)) -> Mesh:
    """A one-axis (by default) mesh of `kind` over exactly `devices`."""
    shape = (len(devices),) + (1,) * (len(names) - 1)
    return make_mesh(kind, shape=shape, names=names, devices=devices)


class Model(eqx.Module):
    """A small model with array leaves (float, int, a PRNG key) and static/non-array leaves."""

    linear: eqx.nn.Linear
    scale: jax.Array
    steps: jax.Array
    key: jax.Array
    activation: Callable = eqx.field(static=True)
    name: str = eqx.field(static=True)
    fn: Callable  # a non-array leaf that is not static: must come back as the same object
    count: int  # a Python int leaf: not an array, never placed

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.activation(self.linear(x)) * self.scale


def make_model(seed: int = 0) -> Model:
    """A `Model` whose array leaves all have a leading dim of 4 (P("data") fits every one)."""
    key = jax.random.key(seed)
    k1, k2 = jax.random.split(key)
    return Model(
        linear=eqx.nn.Linear(8, 4, key=k1),
        scale=jnp.arange(1.0, 5.0),
        steps=jnp.arange(4, dtype=jnp.int32),
        key=jax.random.split(k2, 4),
        activation=jax.nn.relu,
        name="model",
        fn=jnp.tanh,
        count=3,
    )


def tree_data() -> dict[str, Any]:
    """A plain PyTree: jax, NumPy and PRNG key arrays and non-array leaves.

    Every array has a leading dim of 8, so any spec over ("data", "model") fits dim 0.
    """
    return {
        "a": jnp.arange(32.0).reshape(8, 4),
        "b": [np.arange(16, dtype=np.int32).reshape(8, 2), "label"],
        "c": (jnp.ones((8,), jnp.bfloat16), 7, None),
        "key": jax.random.split(jax.random.key(1), 8),
    }


def _values(x: Any) -> np.ndarray:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def assert_equal_value(x: Any, expected: Any) -> None:
    """Same shape, dtype and exact value (PRNG key arrays compared by their key data)."""
    assert x.shape == expected.shape, (x.shape, expected.shape)
    assert x.dtype == expected.dtype, (x.dtype, expected.dtype)
    np.testing.assert_array_equal(_values(x), _values(expected))


def assert_placed(
    x: Any, sharding: Sharding, value: Any = None, *, committed: bool = True, where: str = ""
) -> None:
    """`x` is a `jax.Array` laid out as `sharding`, holding `value` (if given).

    Checks `sharding.is_equivalent_to`, the device set, `committed`, and the value. `where`
    (a leaf path, say) starts the message of a failed check.
    """
    assert isinstance(x, jax.Array), (where, type(x))
    assert x.sharding.is_equivalent_to(sharding, x.ndim), (where, x.sharding, sharding)
    assert x.sharding.device_set == sharding.device_set, where
    assert x.committed is committed, where
    if value is not None:
        assert_equal_value(x, value)


def assert_sharding(actual: Sharding, expected: Sharding, ndim: int) -> None:
    """Two shardings lay out an array of `ndim` dims the same way."""
    assert actual.is_equivalent_to(expected, ndim), (actual, expected)


def assert_statics_same(out: Any, tree: Any) -> None:
    """Same structure; every non-array leaf of `out` is the very same object as in `tree`."""
    out_leaves, out_def = jax.tree_util.tree_flatten(out)
    in_leaves, in_def = jax.tree_util.tree_flatten(tree)
    assert out_def == in_def, (out_def, in_def)
    for a, b in zip(out_leaves, in_leaves, strict=True):
        if not eqx.is_array(b):
            assert a is b, (a, b)


def assert_tree_values(out: Any, tree: Any) -> None:
    """Same structure, every array leaf with the same value and dtype, statics identical."""
    assert_statics_same(out, tree)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(tree), strict=True):
        if eqx.is_array(b):
            assert_equal_value(a, b)


def named(mesh: Mesh, *spec: Any) -> NamedSharding:
    """`NamedSharding(mesh, P(*spec))`."""
    return NamedSharding(mesh, P(*spec))


def is_key(x: Any) -> bool:
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def compiled_total(memory) -> int:
    """Bytes per device of a compiled step, from its `memory_analysis()`, as `auto_plan`
    counts them: arguments and outputs (less what they alias) and temporaries."""
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


def mse_step(optimizer: Any) -> Callable[..., Any]:
    """A training step in `auto_plan`'s form, `step(model, opt_state, (x, y)) -> (model,
    opt_state, loss)`: the mean squared error of `jax.vmap(model)(x)` against `y`, then one
    `optimizer` update. A new function each call (its own entries in `auto_plan`'s cache)."""

    def step(model, opt_state, batch):
        x, y = batch
        loss_fn = lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


def kept_layout_total(
    step: Callable[..., Any], model: Any, opt_state: Any, batch: Any, loss_sharding: Sharding
) -> int:
    """Bytes per device of `step` compiled here (`compiled_total`), the model and the state
    donated and kept in the layout they have, the loss laid out by `loss_sharding`."""
    params, static = eqx.partition(model, eqx.is_array)

    def run(params, opt_state, batch):
        new_model, new_state, loss = step(eqx.combine(params, static), opt_state, batch)
        return eqx.filter(new_model, eqx.is_array), new_state, loss

    out = (
        jax.tree.map(lambda x: x.sharding, params),
        jax.tree.map(lambda x: x.sharding, opt_state),
        loss_sharding,
    )
    jitted = jax.jit(run, donate_argnums=(0, 1), out_shardings=out)
    memory = jitted.lower(params, opt_state, batch).compile().memory_analysis()
    assert memory is not None
    return compiled_total(memory)


def candidate_row(
    name: str, total: int | None, fits: bool, **fields: Any
) -> eqxshard.report.Candidate:
    """A row of an `auto_plan` table, for the search's parts: a data-parallel mesh of 2
    whose only bytes are `total` of activations; `fields` overrides any field."""
    row: dict[str, Any] = dict(
        rank=0,
        name=name,
        mesh_shape={"data": 2},
        rules=P(),
        bytes={"activations": total or 0},
        total_bytes=total,
        collectives={},
        communication_time=0.0,
        compute_time=1.0,
        time=1.0,
        fits=fits,
        estimated=False,
        measured_on="compiled here",
        reason="",
    )
    return eqxshard.report.Candidate(**{**row, **fields})


def numpy_filled(make: Callable[[jax.Array], Any], key: jax.Array, scale: float = 0.1) -> Any:
    """The model `make(key)` builds, its floating-point arrays drawn with NumPy (normal,
    times `scale`) instead: only `make`'s shapes are traced, so none of its eager
    initialisers (op by op, each compiled on first use) runs. For tests whose claim holds
    for any weights."""
    rng = np.random.default_rng(0)

    def fill(leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(f"numpy_filled fills floating-point arrays only, got {leaf.dtype}")
        return jnp.asarray((scale * rng.normal(size=leaf.shape)).astype(leaf.dtype))

    return jax.tree.map(fill, eqx.filter_eval_shape(make, key))


def trains_as_one_device(
    loss: Callable[[Any, Any], Any],
    optimiser: Any,
    one: tuple[Any, Any, Any],
    split: tuple[Any, Any, Any],
    *,
    steps: int = 3,
    rtol: float = 2e-5,
    atol: float = 5e-5,
) -> None:
    """`steps` steps of `optimiser` on `loss(model, batch)`: `one` (model, state, batch)
    under `eqx.filter_jit` on one device, `split` (the converted and laid out model,
    state and batch) under `eqxshard.filter_jit`; each step's loss and the final
    parameters agree."""

    def step(model: Any, state: Any, batch: Any) -> Any:
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        updates, state = optimiser.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, value

    (model, state, batch), (split_model, split_state, laid_out) = one, split
    sharded_step, one_step = eqxshard.filter_jit(step), eqx.filter_jit(step)
    for _ in range(steps):
        split_model, split_state, split_loss = sharded_step(split_model, split_state, laid_out)
        model, state, value = one_step(model, state, batch)
        np.testing.assert_allclose(split_loss, value, rtol=rtol)
    got, want = eqx.filter(split_model, eqx.is_array), eqx.filter(model, eqx.is_array)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=atol, atol=atol)


class MoELayer(eqx.Module):
    """A residual MoE layer: the model's own router (top-2 of a softmax), then
    `eqxshard.Experts` of one-hidden-layer MLPs (`options`: the `Experts`' own)."""

    router: eqx.nn.Linear
    experts: eqxshard.Experts

    def __init__(self, key: Any, *, width: int, hidden: int, experts: int, **options: Any):
        k1, k2 = jax.random.split(key)
        self.router = eqx.nn.Linear(width, experts, use_bias=False, key=k1)
        make = lambda k: eqx.nn.MLP(width, width, hidden, 1, key=k)
        blocks = eqx.filter_vmap(make)(jax.random.split(k2, experts))
        self.experts = eqxshard.Experts(blocks, **options)

    def __call__(self, x: Any) -> Any:
        weights, indices = jax.lax.top_k(jax.nn.softmax(jax.vmap(self.router)(x)), 2)
        return x + self.experts(x, indices, weights)
