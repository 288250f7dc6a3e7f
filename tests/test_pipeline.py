"""`filter_pipeline`: the values, gradients and output layouts of `jax.lax.scan` over the same
layers, on meshes with a stage axis alone and with data and model axes (Auto, Explicit,
mixed), GPipe and circular, eagerly and under `jit`; the compiled program's collectives and
bytes per device; the remat policies."""

from __future__ import annotations

import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P
from tiny_stack import D, N, blocks as _blocks, layer as _layer

import eqxshard
from eqxshard import _compat
from eqxshard._pipeline.spmd.pipeline import run_pipeline
from eqxshard._pipeline.spmd.stage_major import from_stage_major, to_stage_major


def _schedule(repeats: int) -> dict[str, Any]:
    """`filter_pipeline`'s schedule arguments for `repeats` chunks of layers per stage."""
    return {"schedule": "gpipe"} if repeats == 1 else {"schedule": "circular", "repeats": repeats}


def _x(batch=16):
    return jax.random.normal(jax.random.key(2), (batch, D))


def _scan(blocks, x, layer=_layer):
    return jax.lax.scan(lambda h, b: (layer(b, h), None), x, blocks)[0]


def _loss(fn):
    return lambda blocks, x: jnp.sum(jnp.sin(fn(blocks, x)))


@pytest.fixture(scope="module")
def reference():
    """The scan's output and gradients (of `_loss`, for the blocks and x) on the tiny stack,
    computed once for every test of the module that compares with them."""
    out = jax.jit(_scan)(_blocks(), _x())
    grads = jax.jit(jax.grad(_loss(_scan), argnums=(0, 1)))(_blocks(), _x())
    return out, grads


def _close(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)


# (mesh kind, shape, names, the spec of x's batch, repeats). Two on every JAX (Explicit
# GPipe, Auto circular inside a model axis); the other four once, in the tests part.
_ONCE = pytest.mark.heavy
CASES = [
    ("explicit", (4,), ("stage",), P(), 1),
    pytest.param("explicit", (4,), ("stage",), P(), 2, marks=_ONCE),
    pytest.param("auto", (2, 4), ("data", "stage"), P("data"), 1, marks=_ONCE),
    pytest.param("explicit", (2, 4), ("data", "stage"), P("data"), 2, marks=_ONCE),
    pytest.param("mixed", (4, 2), ("stage", "model"), P(), 1, marks=_ONCE),
    ("auto", (4, 2), ("stage", "model"), P(), 2),
]


def _over_model(path, leaf):  # one layer's dims: w's columns and b over "model"
    return P(None, "model") if leaf.ndim == 2 else P("model")


@pytest.mark.parametrize(("kind", "shape", "names", "xspec", "repeats"), CASES)
def test_matches_scan_under_jit(kind, shape, names, xspec, repeats, reference):
    mesh = make_mesh(kind, shape=shape, names=names)
    inner = _over_model if "model" in names else None
    blocks = eqxshard.filter_shard(_blocks(), mesh, eqxshard.stages(inner=inner))
    x = eqxshard.filter_shard(_x(), mesh, xspec)

    def pipe(blocks, x):
        return eqxshard.filter_pipeline(
            _layer, blocks, x, mesh=mesh, microbatches=4, **_schedule(repeats)
        )

    out = jax.jit(pipe)(blocks, x)
    _close(out, reference[0])
    expected = jax.jit(_scan)(jax.device_put(_blocks(), NamedSharding(mesh, P())), x)
    if "model" not in names:  # over an Auto "model" axis, the compiler picks the layout
        assert out.sharding.is_equivalent_to(expected.sharding, 2)
    grads = jax.jit(jax.grad(_loss(pipe), argnums=(0, 1)))(blocks, x)
    _close(grads, reference[1])
    # The gradient of the stack comes back laid out as the stack.
    assert grads[0]["w"].sharding.is_equivalent_to(blocks["w"].sharding, 3)


# Eager pipelines dispatch op by op (minutes on a loaded CI machine for the circular one):
# the circular case runs once, in the heavy part; GPipe's runs on every JAX.
@pytest.mark.parametrize("repeats", [1, pytest.param(2, marks=pytest.mark.heavy)])
def test_eager_equinox_blocks_and_value_and_grad(repeats):
    mesh = make_mesh("explicit", shape=(2, 4), names=("data", "stage"))
    keys = jax.random.split(jax.random.key(3), N)
    blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(keys)
    x = {"a": _x(), "b": _x() * 2}

    def layer(block, h):  # non-array leaves of a block, and h a dict
        return {"a": jnp.tanh(jax.vmap(block)(h["a"])) + h["b"], "b": h["b"] * 0.5}

    def pipe(blocks, x):
        return eqxshard.filter_pipeline(
            layer, blocks, x, mesh=mesh, microbatches=4, **_schedule(repeats), remat="full"
        )

    def scan(blocks, x):
        arrays, static = eqx.partition(blocks, eqx.is_array)
        return _scan(arrays, x, lambda b, h: layer(eqx.combine(b, static), h))

    def loss(fn):
        return lambda blocks, x: jnp.sum(fn(blocks, x)["a"] ** 2)

    _close(pipe(blocks, x), scan(blocks, x))  # eagerly
    # Autodiff of an output on Explicit axes needs the mesh in context (JAX's rule), under
    # `jit` too (eagerly, each op of the pipeline's backward dispatches on its own: a minute).
    # A derivative with respect to the blocks alone, where a part of the output ("b")
    # does not depend on them (jax 0.7's `psum` transpose asserted on one `psum` of both).
    with jax.set_mesh(mesh):
        value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss(pipe)))(blocks, x)
    # The scan's, for the blocks and x at once (one backward pass).
    both = eqx.filter_value_and_grad(lambda bx: loss(scan)(*bx))
    value_ref, (grads_ref, gx_ref) = both((blocks, x))
    _close((value, grads), (value_ref, grads_ref))
    gx = eqx.filter_jit(jax.grad(loss(pipe), argnums=1))(blocks, x)
    _close(gx, gx_ref)


@pytest.mark.parametrize("remat", [None, "none", "dots", "full", "offload"])
def test_remat_policies_keep_values_and_gradients(remat, reference):
    mesh = make_mesh("explicit", shape=(4,), names=("stage",))
    blocks = eqxshard.filter_shard(_blocks(), mesh, eqxshard.stages())

    def pipe(blocks, x):
        return eqxshard.filter_pipeline(_layer, blocks, x, mesh=mesh, microbatches=4, remat=remat)

    if remat == "offload" and not _compat.memory_kinds_in_jit():  # jax < 0.8 on CPU
        with pytest.raises(ValueError, match=r"remat='offload'.* jax 0.8 and newer can"):
            pipe(blocks, _x())
        return
    grads = jax.jit(jax.grad(_loss(pipe), argnums=(0, 1)))(blocks, _x())
    _close(grads, reference[1])


def test_remat_full_recomputes_layers():
    mesh = make_mesh("explicit", shape=(4,), names=("stage",))
    blocks = eqxshard.filter_shard(_blocks(), mesh, eqxshard.stages())

    def text(remat):
        def pipe(blocks, x):
            return eqxshard.filter_pipeline(
                _layer, blocks, x, mesh=mesh, microbatches=4, remat=remat
            )

        return jax.jit(jax.grad(_loss(pipe))).lower(blocks, _x()).as_text()

    # The forward tanh runs again in the backward pass when nothing is kept.
    assert text("full").count("tanh") > text("none").count("tanh")


def _compiled(mesh, repeats, blocks, x, **kwargs):
    def pipe(blocks, x):
        return eqxshard.filter_pipeline(
            _layer, blocks, x, mesh=mesh, microbatches=8, **_schedule(repeats), **kwargs
        )

    return jax.jit(jax.grad(_loss(pipe), argnums=(0, 1))).lower(blocks, x).compile()


def _ops(text, name):
    return [line for line in text.splitlines() if re.search(rf"\b{name}(-start)?\(", line)]


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("repeats", [1, 2])
def test_compiled_program_passes_activations_and_never_gathers_weights(kind, repeats):
    mesh = make_mesh(kind, shape=(8,), names=("stage",))
    n = 8 * repeats * 2
    blocks = eqxshard.filter_shard(_blocks(n), mesh, eqxshard.stages())
    x = eqxshard.filter_shard(_x(), mesh, P())
    compiled = _compiled(mesh, repeats, blocks, x)
    text = compiled.as_text()
    assert _ops(text, "collective-permute"), "activations are not passed by collective permute"
    assert not _ops(text, "all-gather"), "\n".join(_ops(text, "all-gather"))
    # Circular: the contiguous stack regrouped by all-to-all (and its gradients back).
    assert bool(_ops(text, "all-to-all")) == (repeats > 1)
    # Each device holds 1/S of the stacked weights (and the whole, small, x).
    stacked = sum(a.nbytes for a in jax.tree.leaves(blocks))
    memory = compiled.memory_analysis()
    assert memory is not None
    args = memory.argument_size_in_bytes
    assert args == stacked // 8 + x.nbytes


def test_model_axis_splits_each_stage_further():
    # Explicit stage axis, Auto model axis: the compiler lays out the layer's matmul.
    mesh = make_mesh("mixed", shape=(4, 2), names=("stage", "model"))
    rule = eqxshard.stages(inner=eqxshard.path_rules([("w", P(None, "model")), ("b", P())]))
    blocks = eqxshard.filter_shard(_blocks(), mesh, rule)
    x = eqxshard.filter_shard(_x(), mesh, P())
    compiled = _compiled(mesh, 1, blocks, x)
    # The layer's matmul may gather activations over "model"; nothing gathers the stack
    # (an all-gather over the stage axis would give a result with all N layers).
    gathers = _ops(compiled.as_text(), "all-gather")
    assert not [g for g in gathers if re.search(rf"= f32\[{N},", g)], gathers
    memory = compiled.memory_analysis()
    assert memory is not None
    args = memory.argument_size_in_bytes
    w, b = blocks["w"].nbytes, blocks["b"].nbytes
    assert args == w // 8 + b // 4 + x.nbytes  # w split over stage x model, b over stage


def test_ambient_mesh_and_filter_jit(reference):
    mesh = make_mesh("explicit", shape=(2, 4), names=("data", "stage"))
    blocks = eqxshard.filter_shard(_blocks(), mesh, eqxshard.stages())
    x = eqxshard.filter_shard(_x(), mesh, P("data"))

    @eqxshard.filter_jit
    def pipe(blocks, x):
        return eqxshard.filter_pipeline(_layer, blocks, x, microbatches=4)

    with jax.set_mesh(mesh):
        _close(pipe(blocks, x), reference[0])


def test_stage_major_stack_runs_circular_without_moving_weights():
    mesh = make_mesh("explicit", shape=(4,), names=("stage",))
    natural = _blocks(16)
    stored = to_stage_major(natural, 4, 2)
    _close(from_stage_major(stored, 4, 2), natural)
    # Stage s holds chunks s, s+4 of 2 layers each: layers 2s, 2s+1, 2s+8, 2s+9.
    np.testing.assert_array_equal(stored["b"][2:4], natural["b"][8:10])
    blocks = eqxshard.filter_shard(stored, mesh, eqxshard.stages())

    def pipe(blocks, x):
        return run_pipeline(
            "filter_pipeline",
            _layer,
            blocks,
            x,
            mesh=mesh,
            axis="stage",
            microbatches=4,
            repeats=2,
            remat=None,
            stage_major=True,
        )

    _close(jax.jit(pipe)(blocks, _x()), _scan(natural, _x()))
    text = jax.jit(jax.grad(_loss(pipe))).lower(blocks, _x()).compile().as_text()
    assert not _ops(text, "all-to-all") and not _ops(text, "all-gather")
    assert _ops(text, "collective-permute")


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_gpipe_keeps_its_stage_s_weights_once_not_once_per_tick(kind):
    # 8 layers on 4 stages (2 each), 8 microbatches of 2 rows: T = 8 + 4 - 1 = 11 ticks.
    mesh = make_mesh(kind, shape=(4,), names=("stage",))
    blocks = eqxshard.filter_shard(_blocks(), mesh, eqxshard.stages())
    text = _compiled(mesh, 1, blocks, eqxshard.filter_shard(_x(), mesh, P())).as_text()
    assert text is not None
    assert "f32[2,4,4]" in text  # the stage's weights
    assert "f32[11,2,4,4]" not in text  # ... kept for the backward pass at every tick
