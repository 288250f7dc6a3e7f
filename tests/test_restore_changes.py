"""Restores that survive change (issue 20): onto an Explicit mesh and other device counts,
a part of a saved tree, another dtype, and a model changed since the save. Real orbax
underneath; values compared with what was saved, bit for bit."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqxshard
from eqxshard import filter_restore, filter_save


def _tree(seed: int = 0, **shapes):
    key = jax.random.key(seed)
    shapes = shapes or {"w": (8, 4), "b": (8,), "v": (8, 8)}
    return {
        k: jax.random.normal(jax.random.fold_in(key, i), s)
        for i, (k, s) in enumerate(shapes.items())
    }


def _same(a, b) -> None:
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_onto_explicit_meshes_and_fewer_devices(tmp_path: Path) -> None:
    auto = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    saved = eqxshard.filter_shard(_tree(), auto, P("data"))
    filter_save(tmp_path, 0, saved)
    abstract = jax.eval_shape(lambda: _tree())
    # 8 devices onto a (2, 4) Explicit mesh, and onto 4 devices.
    grid = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    four = jax.make_mesh(
        (4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[4:]
    )
    for mesh, spec in ((grid, P("data", "model")), (four, P("data"))):
        out = filter_restore(tmp_path, abstract, mesh, {"w": spec, "b": P("data"), "v": spec})
        for k in saved:
            _same(out[k], saved[k])
        want = NamedSharding(mesh, spec)
        assert out["w"].sharding.is_equivalent_to(want, 2)
        assert out["w"].sharding.mesh.axis_types == mesh.axis_types
        assert out["w"].sharding.device_set == set(mesh.devices.flat)
        # The restored arrays work in a step on that mesh (Explicit axes in context).
        total = jax.jit(lambda t: t["w"].sum() + t["b"].sum())(out)
        np.testing.assert_allclose(total, saved["w"].sum() + saved["b"].sum(), rtol=1e-5)


def test_parameters_from_a_parameters_and_optimiser_checkpoint(tmp_path: Path) -> None:
    mesh = jax.make_mesh((8,), ("data",))
    params = eqxshard.filter_shard(_tree(), mesh, P("data"))
    opt_state = eqxshard.filter_shard(optax.adam(1e-3).init(params), mesh, eqxshard.like(params))
    filter_save(tmp_path, 3, (params, opt_state))
    like = (jax.eval_shape(lambda: _tree()), None)  # the saved structure; `None`: not read
    with pytest.raises(
        ValueError, match=r"(?s)does not match `like`.*1\.0\.mu\.w\s+not in `like`.*strict=False"
    ):
        filter_restore(tmp_path, like, mesh, P("data"))
    restored, nothing = filter_restore(tmp_path, like, mesh, P("data"), strict=False)
    assert nothing is None
    for k in params:
        _same(restored[k], params[k])


def test_into_another_dtype_when_asked(tmp_path: Path) -> None:
    mesh = jax.make_mesh((8,), ("data",))
    saved = eqxshard.filter_shard(_tree(), mesh, P("data"))
    filter_save(tmp_path, 0, saved)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), saved)
    with pytest.raises(
        ValueError,
        match=r"(?s)w\s+in `like` as \(8, 4\) bfloat16\s+"
        r"in the checkpoint as \(8, 4\) float32.*cast=True",
    ):
        filter_restore(tmp_path, like, mesh, P("data"))
    out = filter_restore(tmp_path, like, mesh, P("data"), cast=True)
    for k in saved:
        assert out[k].dtype == jnp.bfloat16
        _same(out[k], saved[k].astype(jnp.bfloat16))
    assert out["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)


def test_after_the_model_changed(tmp_path: Path) -> None:
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    saved = eqxshard.filter_shard(_tree(), mesh, P("data"))
    filter_save(tmp_path, 0, saved)
    # `w` resized, `v` removed, `extra` added.
    new = eqxshard.filter_shard(_tree(1, w=(8, 8), b=(8,), extra=(4,)), mesh, P("data"))
    with pytest.raises(ValueError) as info:
        filter_restore(tmp_path, new, mesh, P("data"))
    text = str(info.value)
    assert "w      in `like` as (8, 8) float32  in the checkpoint as (8, 4) float32" in text
    assert "extra  in `like` as (4,) float32    not in the checkpoint" in text
    assert "v      not in `like`                in the checkpoint as (8, 8) float32" in text
    assert "strict=False" in text  # the way to restore the rest
    with pytest.warns(
        UserWarning,
        match=r"(?s)kept `like`'s own value.*\n  extra  not in the checkpoint"
        r".*\n  w.*saved as \(8, 4\)",
    ):
        out = filter_restore(tmp_path, new, mesh, P("data"), strict=False)
    _same(out["b"], saved["b"])  # restored
    _same(out["w"], new["w"])  # kept, laid out as asked
    _same(out["extra"], new["extra"])
    assert out["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
    abstract = jax.eval_shape(lambda: _tree(1, w=(8, 8), b=(8,)))
    with pytest.raises(ValueError, match=r"(?s)has no value for these leaves.*\n  w"):
        filter_restore(tmp_path, abstract, mesh, P("data"), strict=False)
    for name in ("strict", "cast"):
        with pytest.raises(TypeError, match=f"`{name}` as a bool"):
            options: dict[str, Any] = {name: "yes"}
            filter_restore(tmp_path, new, mesh, P("data"), **options)


def test_an_equinox_model_after_a_layer_was_added(tmp_path: Path) -> None:
    mesh = jax.make_mesh((8,), ("data",))
    old = eqxshard.filter_shard(eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0)), mesh)
    filter_save(tmp_path, 0, old)
    new = eqxshard.filter_shard(eqx.nn.MLP(8, 8, 16, 2, key=jax.random.key(1)), mesh)
    with pytest.warns(UserWarning, match=r"(?s)layers\.2\.weight.*layers\.2\.bias"):
        out = filter_restore(tmp_path, new, mesh, strict=False)
    _same(out.layers[0].weight, old.layers[0].weight)
    _same(out.layers[2].weight, new.layers[2].weight)
    # `layers.1` is the old output layer (16 -> 8) and the new hidden one (16 -> 16).
    _same(out.layers[1].weight, new.layers[1].weight)
    assert out.activation is new.activation


class _Block(eqx.Module):
    lin: eqx.nn.Linear

    def __init__(self, key, width=8):
        self.lin = eqx.nn.Linear(width, width, key=key)

    def __call__(self, h):
        return h + jnp.tanh(self.lin(h))


class _ListModel(eqx.Module):
    """A model written the usual Equinox way: a Python list of blocks."""

    embed: eqx.nn.Embedding
    blocks: Any

    def __init__(self, key, n=8):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(10, 8, key=k1)
        self.blocks = [_Block(k) for k in jax.random.split(k2, n)]


def _stacked(model: _ListModel, **options) -> _ListModel:
    return eqx.tree_at(
        lambda m: m.blocks, model, eqxshard.Stacked.from_layers(model.blocks, **options)
    )


@pytest.mark.parametrize("repeats", [1, 2])
def test_a_list_of_blocks_restores_into_its_stacked_form(tmp_path: Path, repeats: int) -> None:
    saved = _ListModel(jax.random.key(0))
    filter_save(tmp_path, 0, saved)
    mesh = jax.make_mesh((4, 2), ("stage", "data"), axis_types=(AxisType.Auto,) * 2)
    # A circular stack built for this mesh is stored stage-major: read in that order too.
    options = dict(axis="stage", microbatches=4, mesh=mesh) if repeats > 1 else {}
    if repeats > 1:
        options["repeats"] = repeats
    want = _stacked(saved, **options)
    assert (want.blocks.stages is not None) == (repeats > 1)
    rules = eqxshard.first(eqxshard.stages("stage", path=r"blocks\..*"), P())
    like = eqx.filter_eval_shape(lambda: want)
    restored = filter_restore(tmp_path, like, mesh, rules)
    assert bool(eqx.tree_equal(restored, want))
    weight = restored.blocks.blocks.lin.weight
    assert weight.shape == (8, 8, 8)
    assert weight.sharding.is_equivalent_to(NamedSharding(mesh, P("stage")), 3)
    for got, block in zip(restored.blocks.to_layers(), saved.blocks, strict=True):
        np.testing.assert_array_equal(got.lin.weight, block.lin.weight)


def test_a_list_of_blocks_unlike_the_stack_is_one_short_error_with_the_recipe(
    tmp_path: Path,
) -> None:
    saved = _ListModel(jax.random.key(0))
    filter_save(tmp_path, 0, saved)
    wider = eqx.tree_at(
        lambda m: m.blocks,
        saved,
        [_Block(k, width=16) for k in jax.random.split(jax.random.key(1), 8)],
    )
    with pytest.raises(ValueError) as info:
        filter_restore(tmp_path, _stacked(wider), jax.devices()[0])
    text = str(info.value)
    assert re.search(r"blocks\.blocks\.lin\.weight\s+in `like` as \(8, 16, 16\)", text)
    assert "... and 8 more" in text  # 2 stacked leaves + 16 list leaves, 10 shown
    assert "`eqxshard.Stacked` at blocks where the checkpoint holds a list" in text
    assert "eqxshard.Stacked.from_layers(model.blocks)" in text
    assert len(text.splitlines()) < 16
