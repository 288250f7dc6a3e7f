"""A pipelined `Stacked` (`axis` set, the mesh has it) against the plain scan of the same
blocks: called per example inside `jax.vmap`/`eqx.filter_vmap` (the batching rule hands the
pipeline the whole batch) and called on a batch, values and gradients, GPipe and circular,
with the mesh given or set by `jax.set_mesh`, and the collective permutes in its program."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxshard
from eqxshard import Stacked

D = 8


class Block(eqx.Module):
    """A residual MLP block; works on one example `(T, D)` or a batch `(B, T, D)`."""

    w1: jax.Array
    w2: jax.Array

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (D, 2 * D)) / np.sqrt(D)
        self.w2 = jax.random.normal(k2, (2 * D, D)) / np.sqrt(2 * D)

    def __call__(self, h):
        return h + jax.nn.gelu(h @ self.w1) @ self.w2


def make_blocks(key, n):
    """`n` blocks (at most 16), made 16 at a time and sliced: every layer count shares one
    compiled initialisation (each new count would compile JAX's random numbers again)."""
    return jax.tree.map(lambda a: a[:n], eqx.filter_vmap(Block)(jax.random.split(key, 16)))


class Model(eqx.Module):
    """Written per example, as Equinox models are: `(T,)` token ids to `(T, D)` outputs."""

    embed: jax.Array
    blocks: Stacked

    def __init__(self, key, n=8, **pipeline):
        k1, k2 = jax.random.split(key)
        self.embed = jax.random.normal(k1, (16, D))
        self.blocks = Stacked(make_blocks(k2, n), **pipeline)

    def __call__(self, tokens):
        h = self.embed[tokens]  # (T, D): one example
        return self.blocks(h)


def close(a, b, tol=2e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        scale = max(1.0, float(np.abs(np.asarray(y)).max()))
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol * scale)


def loss(model, tokens):
    return jnp.mean(eqx.filter_vmap(model)(tokens) ** 2)


def pipelined(model, **pipeline):
    return eqx.tree_at(lambda m: m.blocks, model, Stacked(model.blocks.blocks, **pipeline))


# Module-wide: the plain model's step is one program, compiled once for every case.
STEP = eqx.filter_jit(eqx.filter_value_and_grad(loss))


@pytest.mark.parametrize("repeats", [1, 2])
@pytest.mark.parametrize("ambient", [False, True])
def test_a_vmapped_model_pipelines_with_the_plain_scan_s_values_and_gradients(repeats, ambient):
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    plain = Model(jax.random.key(0))
    options: dict[str, Any] = dict(axis="stage", microbatches=4, repeats=repeats)
    model = pipelined(plain, **options, **({} if ambient else {"mesh": mesh}))
    tokens = jax.random.randint(jax.random.key(1), (8, 4), 0, 16)
    step = STEP
    value_ref, grads_ref = step(plain, tokens)
    if ambient and repeats > 1:
        # Built with no mesh known: stored in layer order, regrouped every step (warned).
        with jax.set_mesh(mesh), pytest.warns(UserWarning, match=r"stored in layer order"):
            value, grads = step(model, tokens)
    elif ambient:
        with jax.set_mesh(mesh):
            value, grads = step(model, tokens)
    else:
        value, grads = step(model, tokens)
    close(value, value_ref)
    close(in_layer_order(grads, model), grads_ref)


def in_layer_order(grads, model):
    """A model's gradients with its stack's read in layer order (a circular `Stacked` built
    with its mesh stores its layers, and so their gradients, stage-major)."""
    grads = jax.device_get(grads)  # on the host: slices of arrays split over Explicit axes
    stack = eqx.tree_at(lambda s: s.blocks, model.blocks, grads.blocks.blocks)
    layers = Stacked.from_layers(stack.to_layers()).blocks
    return eqx.tree_at(lambda m: m.blocks.blocks, grads, layers)


def test_the_vmapped_pipeline_is_the_pipeline_in_the_program():
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    plain = Model(jax.random.key(0))
    model = pipelined(plain, axis="stage", microbatches=4, mesh=mesh)
    tokens = jnp.zeros((8, 4), jnp.int32)
    text = jax.jit(loss).lower(model, tokens).as_text()
    assert "collective_permute" in text
    assert "collective_permute" not in jax.jit(loss).lower(plain, tokens).as_text()


def test_called_on_a_batch_with_the_batch_split_over_data():
    # Auto axes: under Explicit ones, JAX asks the plain scan's weight gradients (a matmul
    # contracting the batch split over "data") for an `out_sharding`.
    mesh = make_mesh("auto", (4, 2), ("stage", "data"))
    blocks = make_blocks(jax.random.key(0), 8)
    plain = Stacked(blocks, remat="full")
    piped = Stacked(blocks, remat="full", axis="stage", microbatches=4, mesh=mesh)
    x = jax.random.normal(jax.random.key(1), (16, 3, D))  # (batch, T, D)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))

    def batch_loss(stack, x):
        return jnp.mean(stack(x) ** 2)

    grad = jax.jit(jax.value_and_grad(batch_loss, argnums=(0, 1)))
    close(grad(piped, x), grad(plain, x))
    close(piped(x), plain(x))  # eagerly


def test_the_pipeline_s_errors_reach_the_caller():
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    model = pipelined(Model(jax.random.key(0), n=6), axis="stage", microbatches=4, mesh=mesh)
    with pytest.raises(ValueError, match=r"divisible"):
        loss(model, jnp.zeros((8, 4), jnp.int32))  # 6 layers over 4 stages
    model = pipelined(Model(jax.random.key(0)), axis="stage", microbatches=4, mesh=mesh)
    with pytest.raises(ValueError, match=r"microbatches"):
        loss(model, jnp.zeros((6, 4), jnp.int32))  # a batch of 6 in 4 microbatches


def test_stages_rule_lays_out_a_stacked_model():
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    model = pipelined(Model(jax.random.key(0)), axis="stage", microbatches=4, mesh=mesh)
    spec = eqxshard.first(eqxshard.stages("stage", path=r"blocks\.blocks\..*"), P())
    placed = eqxshard.filter_shard(model, mesh, spec)
    assert placed.blocks.blocks.w1.sharding.spec[0] == "stage"
    tokens = jax.random.randint(jax.random.key(1), (8, 4), 0, 16)
    close(loss(placed, tokens), loss(Model(jax.random.key(0)), tokens))


def _ops(text, name):
    return [line for line in text.splitlines() if f" {name}(" in line or f" {name}-start(" in line]


# Built under `jax.set_mesh` (ambient): the same program, checked once, in the tests part.
@pytest.mark.parametrize("ambient", [False, pytest.param(True, marks=pytest.mark.heavy)])
def test_a_circular_stack_is_stored_stage_major_and_moves_no_weights(ambient):
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    blocks = make_blocks(jax.random.key(0), 16)
    options: dict[str, Any] = dict(axis="stage", microbatches=4, repeats=2)
    if ambient:
        with jax.set_mesh(mesh):
            stack = Stacked(blocks, **options)
    else:
        stack = Stacked(blocks, **options, mesh=mesh)
    assert stack.stages == 4
    # Stage 0 holds chunks 0 and 4 (of two layers each): layers 0, 1, 8, 9.
    np.testing.assert_array_equal(stack.blocks.w1[2:4], blocks.w1[8:10])
    close(jax.tree.leaves(stack.to_layers()), jax.tree.leaves(Stacked(blocks).to_layers()))
    stack = eqxshard.filter_shard(stack, mesh, eqxshard.stages("stage", path=r"blocks\..*"))
    plain = Stacked(blocks)
    x = jax.random.normal(jax.random.key(1), (8, 3, D))

    def batch_loss(stack, x):
        return jnp.mean(jax.vmap(stack)(x) ** 2)

    grad = jax.jit(jax.value_and_grad(batch_loss))
    with jax.set_mesh(mesh):  # compiled once: its program read, then run
        compiled = grad.lower(stack, x).compile()
        value, grads = compiled(stack, x)
    text = compiled.as_text()
    assert text is not None
    value_ref, grads_ref = grad(plain, x)
    close(value, value_ref)
    # The gradients are stored stage-major too: read in layer order they are the scan's.
    layers = eqx.tree_at(lambda s: s.blocks, stack, grads.blocks).to_layers()
    close(jax.tree.leaves(layers), jax.tree.leaves(Stacked(grads_ref.blocks).to_layers()))
    assert not _ops(text, "all-to-all"), _ops(text, "all-to-all")
    assert not [g for g in _ops(text, "all-gather") if "f32[16," in g]
    assert _ops(text, "collective-permute")
    # Without the stage axis it is the plain scan, in layer order.
    close(jax.vmap(stack)(x), jax.vmap(plain)(x))


def test_a_stage_major_stack_on_another_stage_count_is_refused():
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    options: dict[str, Any] = dict(axis="stage", microbatches=4, repeats=2)
    with jax.set_mesh(mesh):  # built for 4 stages, called on a mesh of 2
        stack = Stacked(make_blocks(jax.random.key(0), 16), **options)
    with jax.set_mesh(jax.make_mesh((2, 4), ("stage", "data"))):
        with pytest.raises(ValueError, match=r"stage-major for 4 stages.*has 2 along 'stage'"):
            jax.vmap(stack)(jnp.zeros((8, 3, D)))
    options["mesh"] = mesh
    twelve = make_blocks(jax.random.key(0), 12)
    with pytest.raises(ValueError, match=r"cannot store 12 layers stage-major in 4 stages"):
        Stacked(twelve, **options)


def test_a_stage_major_stack_restores_from_its_checkpoint(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    options: dict[str, Any] = dict(axis="stage", microbatches=4, repeats=2, mesh=mesh)
    saved = Model(jax.random.key(0), n=16, **options)
    rules = eqxshard.first(eqxshard.stages("stage", path=r"blocks\.blocks\..*"), P())
    eqxshard.filter_save(str(tmp_path), 0, eqxshard.filter_shard(saved, mesh, rules))
    like = eqx.filter_eval_shape(lambda k: Model(k, n=16, **options), jax.random.key(1))
    restored = eqxshard.filter_restore(str(tmp_path), like, mesh, rules)
    assert restored.blocks.stages == 4
    tokens = jax.random.randint(jax.random.key(1), (8, 4), 0, 16)
    close(loss(restored, tokens), loss(Model(jax.random.key(0), n=16), tokens))


def test_a_stack_saved_in_another_order_is_refused_not_reordered(tmp_path):
    """The stored order is in the saved leaves' names: a restore across orders fails,
    naming the leaves, instead of loading the layers in the wrong order."""
    pytest.importorskip("orbax.checkpoint")
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    options: dict[str, Any] = dict(axis="stage", microbatches=4, repeats=2, mesh=mesh)
    rules = eqxshard.first(eqxshard.stages("stage", path=r"blocks\.blocks\..*"), P())
    in_layer_order = Model(jax.random.key(0), n=16)
    stage_major = Model(jax.random.key(0), n=16, **options)
    eqxshard.filter_save(str(tmp_path / "layers"), 0, in_layer_order)
    eqxshard.filter_save(
        str(tmp_path / "major"), 0, eqxshard.filter_shard(stage_major, mesh, rules)
    )
    as_major = eqx.filter_eval_shape(lambda k: Model(k, n=16, **options), jax.random.key(1))
    with pytest.raises(ValueError, match=r"(?s)blocks\.stage_major_4x2\..*restores only into"):
        eqxshard.filter_restore(str(tmp_path / "layers"), as_major, mesh, rules)
    as_layers = eqx.filter_eval_shape(lambda k: Model(k, n=16), jax.random.key(1))
    with pytest.raises(ValueError, match=r"(?s)stage_major_4x2.*not in `like`.*restores only"):
        eqxshard.filter_restore(str(tmp_path / "major"), as_layers, mesh, P())
    # Each into its own order: the same model.
    back = eqxshard.filter_restore(str(tmp_path / "layers"), as_layers, mesh, P())
    tokens = jax.random.randint(jax.random.key(1), (8, 4), 0, 16)
    close(loss(back, tokens), loss(in_layer_order, tokens))


def test_a_plan_reconfigures_a_stage_major_stack_from_its_layers():
    from eqxshard._pipeline.stacked.configure import configure, configure_like

    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    options: dict[str, Any] = dict(axis="stage", microbatches=4, repeats=2, mesh=mesh)
    model = Model(jax.random.key(0), n=16, **options)
    layers = jax.tree.leaves(model.blocks.to_layers())
    remat = {"blocks": "full"}
    again = configure("Plan.apply", model, remat=remat, pipeline=None, mesh=mesh)
    assert again.blocks.stages == 4 and again.blocks.remat == "full"
    close(jax.tree.leaves(again.blocks.to_layers()), layers)
    # GPipe: layer order; an optimiser state stored like `model` follows it there.
    gpipe = dict(axis="stage", microbatches=4, repeats=1)
    plain = configure("Plan.apply", model, remat={}, pipeline=gpipe, mesh=mesh)
    assert plain.blocks.stages is None
    close(jax.tree.leaves(plain.blocks.to_layers()), layers)
    state = configure_like({"mu": model}, plain)
    close(state["mu"].blocks.blocks.w1, plain.blocks.blocks.w1)
