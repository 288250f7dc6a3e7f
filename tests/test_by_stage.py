"""`ShardingTable.by_stage`: each pipeline stage's layers and bytes, on a concrete mesh and
on an `AbstractMesh`, with other leaves and other axes beside the stack."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

import eqxshard
from eqxshard import StageRow


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
    assert rows == [StageRow(s, range(2 * s, 2 * s + 2), expect) for s in range(4)]
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
