"""`Stacked`: a stack of blocks run by one `lax.scan`, compared with the same blocks run one
after another in Python (values and gradients, eagerly and under `jit`, per example and
under `vmap`), each `remat` policy, one traced layer for any depth, the conversion from a
list of blocks (and from a checkpoint of the list form), and the batching rule that hands
a pipeline the whole batch under `vmap`. The pipelined `Stacked` is in
`tests/test_stacked_pipeline.py`."""

from __future__ import annotations

import re
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import eqxshard
from eqxshard import Stacked
from eqxshard._pipeline.stacked.batching import batched_call, batching_of

D = 8
CALLS = [0]  # how many times a Block was traced or called in Python


class Block(eqx.Module):
    """A residual MLP block; works on one example `(D,)` or a batch `(B, D)`."""

    w1: jax.Array
    w2: jax.Array
    act: Callable = eqx.field(static=True)

    def __init__(self, key, act=jax.nn.gelu):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (D, 2 * D)) / np.sqrt(D)
        self.w2 = jax.random.normal(k2, (2 * D, D)) / np.sqrt(2 * D)
        self.act = act

    def __call__(self, h):
        CALLS[0] += 1
        return h + self.act(h @ self.w1) @ self.w2


def make_blocks(n, seed=0):
    """`n` blocks (at most 12), made 12 at a time and sliced: every layer count shares one
    compiled initialisation (each new count would compile JAX's random numbers again)."""
    blocks = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(seed), 12))
    return jax.tree.map(lambda a: a[:n], blocks)


def loop(layers, h):
    for layer in layers:
        h = layer(h)
    return h


def close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-5)


def loss_stacked(stack, x):
    return jnp.sum(jax.vmap(stack)(x) ** 2)


def loss_loop(layers, x):
    return jnp.sum(jax.vmap(lambda h: loop(layers, h))(x) ** 2)


@pytest.fixture(scope="module")
def loop_reference():
    """The Python loop's value and gradients on 5 blocks, its output for one example and for
    a batch: computed once for every case that compares with them."""
    layers = Stacked(make_blocks(5)).to_layers()
    x = jax.random.normal(jax.random.key(1), (4, D))
    value, g = eqx.filter_jit(eqx.filter_value_and_grad(loss_loop))(layers, x)
    return x, value, g, loop(layers, x[0]), loop(layers, x)


@pytest.mark.parametrize(
    "remat, jit",
    [
        ("none", False),
        ("none", True),
        ("dots", True),
        ("full", False),
        ("offload", True),
        (None, False),
    ],
)
def test_values_and_gradients_equal_the_python_loop(remat, jit, loop_reference):
    x, value_ref, g_ref, one_ref, batch_ref = loop_reference
    stack = Stacked(make_blocks(5), remat=remat)
    grad = eqx.filter_value_and_grad(loss_stacked)
    if jit:
        grad = eqx.filter_jit(grad)
    value, g = grad(stack, x)
    close(value, value_ref)
    close(g.to_layers(), g_ref)
    close(stack(x[0]), one_ref)  # one example
    close(stack(x), batch_ref)  # a batch, for blocks that take one


def test_pytree_activations_and_shared_non_array_leaves():
    class Pair(eqx.Module):
        w: jax.Array
        scale: float = eqx.field(static=True)

        def __call__(self, h):
            a, b = h
            return jnp.tanh(a @ self.w) * self.scale, b + a.sum()

    blocks = eqx.filter_vmap(lambda k: Pair(jax.random.normal(k, (D, D)), 0.5))(
        jax.random.split(jax.random.key(0), 3)
    )
    stack = Stacked(blocks)
    h = (jnp.ones(D), jnp.zeros(()))
    close(stack(h), loop(stack.to_layers(), h))
    assert stack.blocks.scale == 0.5 and stack.n == 3


@pytest.mark.parametrize("n", [1, 3, 12])
def test_one_layer_is_traced_for_any_depth(n):
    stack = Stacked(make_blocks(n), remat="dots")
    x = jnp.ones((2, D))
    CALLS[0] = 0
    fn = jax.jit(jax.grad(lambda s: jnp.sum(jax.vmap(s)(x))))
    hlo = fn.lower(stack).as_text()
    assert CALLS[0] == 1  # the scan traces the block once; JAX transforms its jaxpr
    assert "while" in hlo or "stablehlo.while" in hlo
    # The forward and backward loops each hold one layer's two matmuls (plus, with
    # "dots" remat, none recomputed): far fewer than n layers' worth once n grows.
    assert len(re.findall(r"dot_general", hlo)) <= 6


def test_remat_policies_reach_the_program():
    stack = Stacked(make_blocks(2))
    x = jnp.ones((2, D))
    for remat, expect in [("none", False), ("dots", True), ("full", True), ("offload", True)]:
        s = Stacked(stack.blocks, remat=remat)
        jaxpr = str(jax.make_jaxpr(jax.grad(lambda s: jnp.sum(jax.vmap(s)(x))))(s))
        assert ("remat" in jaxpr or "checkpoint" in jaxpr) is expect, remat


def test_full_remat_keeps_less_than_none_for_the_backward_pass():
    stack = Stacked(make_blocks(8))
    x = jnp.ones((64, D))

    def temp_bytes(remat):
        s = Stacked(stack.blocks, remat=remat)
        fn = jax.jit(jax.grad(lambda s: jnp.sum(jax.vmap(s)(x) ** 2)))
        memory = fn.lower(s).compile().memory_analysis()
        assert memory is not None
        return memory.temp_size_in_bytes

    assert temp_bytes("full") < temp_bytes("none")


def test_from_layers_and_to_layers_round_trip():
    layers = [Block(k) for k in jax.random.split(jax.random.key(3), 4)]
    stack = Stacked.from_layers(layers, remat="full")
    assert stack.n == 4 and stack.remat == "full" and stack.blocks.w1.shape == (4, D, 2 * D)
    assert stack.blocks.act is layers[0].act  # shared non-array leaves are kept as they are
    back = stack.to_layers()
    for a, b in zip(back, layers, strict=True):
        assert eqx.tree_equal(a, b)
    x = jnp.arange(float(D))
    close(stack(x), loop(layers, x))


def test_a_model_with_a_list_of_layers_restores_into_its_stacked_form(tmp_path):
    pytest.importorskip("orbax.checkpoint")

    class ListModel(eqx.Module):
        layers: list

        def __init__(self, key):
            self.layers = [Block(k) for k in jax.random.split(key, 4)]

        def __call__(self, h):
            for layer in self.layers:
                h = layer(h)
            return h

    class StackedModel(eqx.Module):
        layers: Stacked

        def __init__(self, key):
            self.layers = Stacked(eqx.filter_vmap(Block)(jax.random.split(key, 4)))

        def __call__(self, h):
            return self.layers(h)

    mesh = jax.make_mesh((8,), ("data",))
    saved = eqxshard.filter_replicate(ListModel(jax.random.key(0)), mesh)
    eqxshard.filter_save(str(tmp_path), 0, saved)
    # The recipe of docs/pipelines.md: restore the list form, then stack its layers.
    like = eqx.filter_eval_shape(ListModel, jax.random.key(0))
    restored = eqxshard.filter_restore(str(tmp_path), like, mesh, P())
    model = eqx.tree_at(
        lambda m: m.layers,
        eqx.filter_eval_shape(StackedModel, jax.random.key(0)),
        Stacked.from_layers(restored.layers),
    )
    x = jnp.ones(D)
    close(model(x), saved(x))
    assert model.layers.blocks.w1.shape == (4, D, 2 * D)


def test_construction_errors():
    blocks = make_blocks(3)
    with pytest.raises(ValueError, match=r"no array leaves"):
        Stacked({"a": "not an array"})
    bad = {"w": jnp.ones((3, 2)), "v": jnp.ones(3), "b": jnp.ones((4,)), "s": jnp.ones(())}
    with pytest.raises(ValueError, match=r"same leading.*most have 3(.|\n)*\n  b\s+shape \(4,\)"):
        Stacked(bad)
    with pytest.raises(ValueError, match=r"\n  s\s+shape \(\)"):
        Stacked(bad)
    with pytest.raises(ValueError, match=r"remat=.*'none', 'dots', 'full', 'offload'"):
        Stacked(blocks, remat="some")
    with pytest.raises(ValueError, match=r"`microbatches` without `axis`"):
        Stacked(blocks, microbatches=4)
    with pytest.raises(ValueError, match=r"`repeats` without `axis`"):
        Stacked(blocks, repeats=2)
    with pytest.raises(TypeError, match=r"`axis=3`; expected a mesh axis name"):
        Stacked(blocks, axis=3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"`microbatches=None` with `axis='stage'`"):
        Stacked(blocks, axis="stage")
    with pytest.raises(TypeError, match=r"`repeats=0` .* positive int"):
        Stacked(blocks, axis="stage", microbatches=2, repeats=0)
    with pytest.raises(TypeError, match=r"`mesh` of type str"):
        Stacked(blocks, axis="stage", microbatches=2, mesh="mesh")  # pyright: ignore[reportArgumentType]


def test_from_layers_errors():
    with pytest.raises(ValueError, match=r"non-empty list"):
        Stacked.from_layers([])
    a, b = (Block(k) for k in jax.random.split(jax.random.key(0), 2))
    wide = eqx.tree_at(lambda m: m.w2, b, jnp.ones((2 * D, D + 1)))
    with pytest.raises(ValueError, match=r"layers\.1\.w2\s+float32\(16, 9\)\s+layers\.0 has"):
        Stacked.from_layers([a, wide])
    other = Block(jax.random.key(1), act=jax.nn.relu)
    with pytest.raises(ValueError, match=r"layers\.2\.act\s+relu\s+layers\.0 has"):
        Stacked.from_layers([a, b, other])
    # A structure unlike layers.0's: the field that differs, by path.
    w = jnp.ones((4,))
    with pytest.raises(
        ValueError, match=r"\n  layers\.1\.b\s+missing\s+layers\.0 has float32\(4,\)\n"
    ):
        Stacked.from_layers([{"a": w, "b": w}, {"a": w}])
    with pytest.raises(ValueError, match=r"\n  layers\.1\.c\s+a leaf layers\.0 lacks\n"):
        Stacked.from_layers([{"a": w}, {"a": w, "c": w}])
    with pytest.raises(ValueError, match=r"\n  layers\.1\s+tuple\s+layers\.0 has list\n"):
        Stacked.from_layers([[w], (w,)])


def test_iterating_a_stack_says_to_call_it():
    stack = Stacked(make_blocks(2))
    with pytest.raises(
        TypeError, match=r"Replace `for block in self\.blocks: h = block\(h\)` with"
    ):
        for _ in stack:
            pass


def test_without_a_stage_axis_in_the_mesh_a_configured_stack_is_the_plain_scan():
    stack = Stacked(make_blocks(4), axis="stage", microbatches=2)
    x = jnp.ones((4, D))
    ref = loop(stack.to_layers(), x)
    close(stack(x), ref)  # no mesh at all
    # A mesh without "stage": the plain scan still, but not silently (the pipeline is off).
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):
        with pytest.warns(eqxshard.FallbackWarning, match=r"no axis 'stage', only \('data',\)"):
            close(jax.jit(jax.vmap(stack))(x), ref)
    typo = Stacked(make_blocks(4), axis="stages", microbatches=2)
    with jax.set_mesh(jax.make_mesh((4, 2), ("stage", "data"))):
        with pytest.warns(eqxshard.FallbackWarning, match=r"Did you mean 'stage'\? Pass `axis=`"):
            close(typo(x), ref)


def test_per_example_gradients_of_a_pipelined_stack_are_refused():
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    stack = Stacked(make_blocks(4), axis="stage", microbatches=2, mesh=mesh)
    x = jnp.ones((4, D))
    per_example = jax.vmap(jax.grad(lambda h: jnp.sum(stack(h))))
    with pytest.raises(ValueError, match=r"under `jax.grad`.*inside `jax.vmap`"):
        per_example(x)


# The batching rule: `batched_call` runs `on_batch` once on the whole batch under `vmap`.


def _scan_fn(params, h):
    return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, params)[0]


@pytest.mark.parametrize("jit", [False, True])
def test_batched_call_hands_the_whole_batch_to_on_batch(jit):
    seen = []

    def on_batch(params, hs):
        seen.append(hs.shape)
        return jax.vmap(_scan_fn, in_axes=(None, 0))(params, hs)

    def per_example_model(params, h):
        assert batching_of(h) == "innermost"
        return batched_call(_scan_fn, on_batch, params, h)

    params = jax.random.normal(jax.random.key(0), (3, D, D)) / np.sqrt(D)
    x = jax.random.normal(jax.random.key(1), (6, D))

    def loss(params, x, model):
        return jnp.sum(jax.vmap(model, in_axes=(None, 0))(params, x) ** 2)

    grad = jax.value_and_grad(loss, argnums=(0, 1))
    if jit:
        grad = jax.jit(grad, static_argnums=2)
    value, g = grad(params, x, per_example_model)
    value_ref, g_ref = grad(params, x, _scan_fn)
    close((value, g), (value_ref, g_ref))
    assert seen and all(shape == (6, D) for shape in seen)


def test_batched_call_falls_back_to_vmap_when_params_are_batched():
    seen = []

    def on_batch(params, hs):
        seen.append(hs.shape)
        return jax.vmap(_scan_fn, in_axes=(None, 0))(params, hs)

    params = jax.random.normal(jax.random.key(0), (5, 3, D, D)) / np.sqrt(D)  # 5 models
    x = jax.random.normal(jax.random.key(1), (5, D))
    out = jax.vmap(lambda p, h: batched_call(_scan_fn, on_batch, p, h))(params, x)
    close(out, jax.vmap(_scan_fn)(params, x))
    assert not seen


def test_batching_of_tells_where_the_vmap_is():
    assert batching_of(jnp.ones(3)) == "none"
    states = []
    jax.vmap(lambda h: states.append(batching_of(h)) or h)(jnp.ones((2, 3)))
    jax.jit(lambda x: jax.vmap(lambda h: states.append(batching_of(h)) or h)(x))(jnp.ones((2, 3)))
    jax.grad(lambda x: jnp.sum(jax.vmap(lambda h: states.append(batching_of(h)) or h)(x)))(
        jnp.ones((2, 3))
    )
    jax.vmap(jax.grad(lambda h: states.append(batching_of(h)) or jnp.sum(h)))(jnp.ones((2, 3)))
    jax.grad(lambda h: states.append(batching_of(h)) or jnp.sum(h))(jnp.ones(3))
    assert states == ["innermost", "innermost", "innermost", "beneath", "none"]


def test_the_plain_scan_runs_on_a_layer_dim_split_over_explicit_axes():
    mesh = jax.make_mesh((4, 2), ("stage", "data"), axis_types=(AxisType.Explicit,) * 2)
    stack = Stacked(make_blocks(8))
    placed = eqxshard.filter_shard(stack, mesh, P("stage"))
    x = jnp.ones((2, D))
    ref = loop(stack.to_layers(), x)
    close(jax.jit(lambda s, x: s(x))(placed, x), ref)
    close(placed(x), ref)
