"""The `stages` rule: the layer dim of stacked leaves over the stage axis, alone, with
`path=` in `first(...)`, with `inner` rules for one layer's dims; taken by `filter_shard`,
`filter_shardings`, `filter_init` and `describe`; and its errors."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxshard


class Model(eqx.Module):
    embed: jax.Array
    blocks: eqx.nn.Linear  # stacked: every array leaf has a leading layer dim

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = jax.random.normal(k1, (8, 16))
        keys = jax.random.split(k2, 8)
        self.blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(16, 16, key=k))(keys)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("explicit", shape=(4, 2), names=("stage", "model"))


def _spec(x, mesh):
    return x.sharding.spec if isinstance(x.sharding, NamedSharding) else None


def test_every_leaf_of_the_stack(mesh):
    blocks = Model(jax.random.key(0)).blocks
    placed = eqxshard.filter_shard(blocks, mesh, eqxshard.stages())
    for leaf in (placed.weight, placed.bias):
        assert leaf is not None
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, P("stage")), leaf.ndim)
    assert placed.in_features == 16  # statics untouched


def test_path_in_first_with_other_rules(mesh):
    rule = eqxshard.first(eqxshard.stages(path=r"blocks\..*"), P(None, "model"))
    placed = eqxshard.filter_shard(Model(jax.random.key(0)), mesh, rule)
    assert placed.blocks.weight.sharding.is_equivalent_to(NamedSharding(mesh, P("stage")), 3)
    assert placed.embed.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)


def test_inner_lays_out_one_layer(mesh):
    inner = eqxshard.path_rules([(r".*weight", P("model", None)), (r".*bias", P("model"))])
    rule = eqxshard.stages(path=r"blocks\..*", inner=inner) | P()
    plan = eqxshard.filter_shardings(Model(jax.random.key(0)), mesh, rule)
    assert plan.blocks.weight.spec == P("stage", "model", None)
    assert plan.blocks.bias.spec == P("stage", "model")
    assert plan.embed.spec == P()
    inner_none = eqxshard.stages(inner=lambda path, leaf: None)
    plan = eqxshard.filter_shardings(Model(jax.random.key(0)).blocks, mesh, inner_none)
    assert plan.weight.spec == P("stage")


def test_filter_init_and_describe(mesh):
    rule = eqxshard.stages(path=r"blocks\..*") | eqxshard.fsdp("model", min_size=0)
    model = eqxshard.filter_init(Model, mesh, rule)(jax.random.key(0))
    weight = model.blocks.weight
    assert weight.sharding.is_equivalent_to(NamedSharding(mesh, P("stage")), 3)
    assert [s.data.shape for s in weight.addressable_shards][0] == (2, 16, 16)
    table = eqxshard.describe(Model(jax.random.key(0)), mesh, rule)
    blocks_bytes = (8 * 16 * 16 + 8 * 16) * 4
    embed_bytes = 8 * 16 * 4
    assert table.max_bytes_per_device == blocks_bytes // 4 + embed_bytes // 2


def test_stacked_leaves_for_filter_pipeline(mesh):
    stage_mesh = make_mesh("auto", shape=(8,), names=("stage",))
    blocks = {"w": jnp.ones((8, 4, 4)) * 0.1}
    placed = eqxshard.filter_shard(blocks, stage_mesh, eqxshard.stages())
    out = eqxshard.filter_pipeline(
        lambda b, h: h @ b["w"], placed, jnp.ones((8, 4)), mesh=stage_mesh, microbatches=8
    )
    assert out.shape == (8, 4)


def test_layer_dim_not_divisible(mesh):
    with pytest.raises(ValueError, match=r"leading \(layer\) dim is not divisible by the 4"):
        eqxshard.filter_shard({"w": jnp.ones((6, 2))}, mesh, eqxshard.stages())


def test_scalar_leaf(mesh):
    with pytest.raises(ValueError, match=r"cannot lay out these leaves with `stages`") as info:
        eqxshard.filter_shard({"w": jnp.ones((8, 2)), "t": jnp.ones(())}, mesh, eqxshard.stages())
    assert "\n  t  " in str(info.value) and "\n  w  " not in str(info.value)


def test_axis_not_in_mesh(mesh):
    with pytest.raises(ValueError, match=r"`stages` over the mesh axis 'pipe', which the mesh"):
        eqxshard.filter_shard({"w": jnp.ones((8, 2))}, mesh, eqxshard.stages("pipe"))


def test_inner_over_the_stage_axis(mesh):
    rule = eqxshard.stages(inner=P(None, "stage"))
    with pytest.raises(ValueError, match=r"`inner` rule that lays out one layer over the stage"):
        eqxshard.filter_shard({"w": jnp.ones((8, 4, 4))}, mesh, rule)


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"`stages` takes `axis` as a mesh axis name"):
        eqxshard.stages(3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"`stages\(path=...\)` takes a regular expression"):
        eqxshard.stages(path="blocks[")


def test_repr():
    assert repr(eqxshard.stages(path="b.*")) == "stages(axis='stage', path='b.*', inner=None)"
