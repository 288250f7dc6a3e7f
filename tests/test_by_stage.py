"""`ShardingTable.by_stage`: each pipeline stage's layers and bytes, on a concrete mesh and
on an `AbstractMesh`, with other leaves and other axes beside the stack."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

import eqxshard
from eqxshard.report import StageRow


def tree():
    blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(64, 64, key=k))(
        jax.random.split(jax.random.key(0), 8)
    )
    return {"blocks": blocks, "head": jnp.ones((64, 32))}


SPEC = {"blocks": P("stage", "data"), "head": P()}


@pytest.mark.parametrize("abstract", [False, True])
def test_each_stage_holds_its_layers_and_their_bytes(abstract):
    if abstract:
        mesh = AbstractMesh((4, 2), ("stage", "data"))
        t = eqxshard.describe(eqx.filter_eval_shape(tree), mesh, SPEC)
    else:
        mesh = jax.make_mesh((4, 2), ("stage", "data"))
        t = eqxshard.describe(tree(), mesh, SPEC)
    rows = t.by_stage("stage")
    # Per device: 2 layers' weight rows split over "data" (2*64*64*4/2), bias (2*64*4/2),
    # and the whole head (64*32*4).
    expect = 2 * 64 * 64 * 4 // 2 + 2 * 64 * 4 // 2 + 64 * 32 * 4
    assert rows == [StageRow(s, (2 * s, 2 * s + 1), expect) for s in range(4)]
    assert str(rows[1]) == "stage 1: layers 2-3, 24.2 KiB per device"
    assert t.by_stage() == rows  # "stage" is the default


def test_one_layer_per_stage_reads_as_one_layer():
    mesh = jax.make_mesh((8,), ("stage",))
    rows = eqxshard.describe(tree(), mesh, {"blocks": P("stage"), "head": P()}).by_stage()
    assert str(rows[7]).startswith("stage 7: layer 7, ")


def test_no_leaf_over_the_axis_is_an_error():
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    table = eqxshard.describe(tree(), mesh, SPEC)
    with pytest.raises(
        ValueError, match=r"no leaf whose leading \(layer\) dim is split over .*'data'"
    ):
        table.by_stage("data")


@pytest.mark.parametrize("stages", [2, 4])
def test_a_circular_stack_stored_stage_major_lists_its_layer_numbers(stages):
    """Each stage's row lists the layers the circular schedule runs on it (chunk `c` of
    `n/(S*R)` layers on stage `c % S`), numbered as `to_layers` orders them."""
    n, repeats = 16, 2
    mesh = jax.make_mesh((stages, 8 // stages), ("stage", "data"))
    blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(
        jax.random.split(jax.random.key(0), n)
    )
    stack = eqxshard.Stacked(blocks, axis="stage", microbatches=stages, repeats=repeats, mesh=mesh)
    model = {"stack": stack, "head": jnp.ones(3)}
    assert model["stack"].stages == stages
    rules = eqxshard.first(eqxshard.stages("stage", path=r"stack\.blocks\..*"), P())
    rows = eqxshard.describe(model, mesh, rules).by_stage()
    chunk = n // (stages * repeats)
    for s, row in enumerate(rows):
        assert row.layers == tuple(i for i in range(n) if (i // chunk) % stages == s)
    # The numbers are layer order's: stage s's stored weights are those layers'.
    layers = model["stack"].to_layers()
    stored = model["stack"].blocks.weight[: n // stages]
    expect = jnp.stack([layers[i].weight for i in rows[0].layers])
    assert jnp.array_equal(stored, expect)
    # An abstract model is numbered the same way.
    abstract = eqx.filter_eval_shape(lambda: model)
    assert eqxshard.describe(abstract, mesh, rules).by_stage() == rows
    if stages == 2:
        assert str(rows[0]).startswith("stage 0: layers 0-3, 8-11, ")
    # The same stack in layer order holds contiguous layers.
    plain = {"stack": eqxshard.Stacked(blocks), "head": jnp.ones(3)}
    rows = eqxshard.describe(plain, mesh, rules).by_stage()
    assert rows[1].layers == tuple(range(n // stages, 2 * n // stages))
