"""`describe`: the per-leaf, per-device table of a plan or a placed tree."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import MESH_KINDS, make_mesh
from jax.sharding import AxisType, PartitionSpec as P

import eqxshard
from eqxshard import _compat, describe, fsdp, path_rules
from eqxshard._tree import format_bytes
from eqxshard.report import ShardingTable


def tree() -> dict:
    return {
        "big": jnp.ones((64, 16), jnp.float32),  # 4 KiB
        "half": jnp.ones((8, 4), jnp.bfloat16),  # 64 B
        "bias": jnp.ones((16,), jnp.float32),  # 64 B
        "key": jax.random.split(jax.random.key(0), 8),  # 8 keys of 8 bytes
        "name": "not an array",
    }


def by_path(table: ShardingTable) -> dict:
    return {row.path: row for row in table.rows}


@pytest.mark.parametrize("kind", MESH_KINDS)
@pytest.mark.parametrize("abstract", [False, True])
def test_plan_rows_and_bytes_per_device(kind: str, abstract: bool) -> None:
    mesh = make_mesh(kind)  # data: 4, model: 2
    t = eqx.filter_eval_shape(tree) if abstract else tree()
    rules = path_rules([(r"big", P("data", "model")), (r"half|key", P("data")), (r".*", P())])
    table = describe(t, mesh, rules)
    rows = by_path(table)
    assert list(rows) == ["bias", "big", "half", "key"]  # sorted dict keys, arrays only
    assert rows["big"].bytes == 4096 and rows["big"].bytes_per_device == 512
    assert rows["big"].spec == "P('data', 'model')" and rows["big"].shape == (64, 16)
    assert rows["half"].dtype == "bfloat16" and rows["half"].bytes_per_device == 16
    assert rows["key"].bytes == 64 and rows["key"].bytes_per_device == 16
    assert rows["bias"].replicated and rows["bias"].bytes_per_device == 64
    assert table.total_bytes == 4096 + 64 + 64 + 64
    assert len(table.bytes_per_device) == 8
    assert set(table.bytes_per_device.values()) == {512 + 16 + 16 + 64}
    assert table.max_bytes_per_device == 608
    assert [r.path for r in table.unsharded] == ["bias"]


def test_placed_tree_reads_its_own_shardings() -> None:
    mesh = make_mesh("explicit")
    t = tree()
    placed = eqxshard.filter_shard(
        t, mesh, {"big": P("data"), "half": None, "bias": P(), "key": P("data"), "name": None}
    )
    placed["half"] = np.ones((8, 4), np.float32)  # host data: not placed
    placed["bias"] = jax.device_put(t["bias"], jax.devices()[5])
    table = describe(placed)
    rows = by_path(table)
    assert rows["big"].spec == "P('data')" and rows["big"].bytes_per_device == 1024
    assert rows["half"].spec == "-" and rows["half"].bytes_per_device is None
    assert rows["bias"].spec == "device cpu:5" and rows["bias"].replicated
    assert table.bytes_per_device[jax.devices()[5]] == 1024 + 16 + 64
    assert table.bytes_per_device[jax.devices()[0]] == 1024 + 16
    assert table.unsharded == []  # a leaf on one device is not "whole on every device"
    # An abstract tree with no shardings: nothing placed.
    empty = describe(eqx.filter_eval_shape(tree))
    assert empty.bytes_per_device == {} and all(r.sharding is None for r in empty.rows)


def test_str_and_html() -> None:
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    abstract = eqx.filter_eval_shape(lambda: {"w<1>": jnp.ones((64, 64)), "b": jnp.ones(64)})
    table = describe(abstract, mesh, fsdp("data", min_size=100))
    text = str(table)
    lines = text.splitlines()
    assert lines[0].split() == ["path", "shape", "dtype", "spec", "per", "device", "total"]
    assert "w<1>  (64, 64)  float32  P('data')     2.0 KiB  16.0 KiB" in lines
    assert "Each of the 8 devices holds 2.2 KiB." in text
    assert "Largest unsharded leaves (whole on every device): b (256 B)." in text
    assert repr(table) == text
    html = table._repr_html_()
    assert html.startswith('<div class="eqxshard-describe">') and "w<1>" not in html
    assert "<code>w&lt;1&gt;</code>" in html and "Each of the 8 devices holds 2.2 KiB.</p>" in html


def test_uneven_devices_are_listed_and_root_path() -> None:
    placed = jax.device_put(jnp.ones(4), jax.devices()[1])
    text = str(describe(placed))
    assert text.splitlines()[1].startswith("<root>")
    assert "Each of the 1 devices holds 16 B." in text
    two = describe([placed, jax.device_put(jnp.ones(8), jax.devices()[2])])
    assert "Bytes per device: cpu:1: 16 B, cpu:2: 32 B." in str(two)


def test_describe_checks_like_filter_shard() -> None:
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    with pytest.raises(ValueError, match="`describe` cannot split these leaves with `fsdp`"):
        describe({"a": jnp.ones((6, 6))}, mesh, fsdp("data", min_size=0))


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (3 * 2**30, "3.0 GiB"),
        (2**50, "1024.0 TiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


# ------------------------------------------- sizing a run on a mesh with no devices at all


def test_abstract_mesh_counts_bytes_on_each_position() -> None:
    mesh = _compat.abstract_mesh((64, 8), ("data", "model"))
    shapes = {
        "w": jax.ShapeDtypeStruct((128, 24), jnp.float32),  # 2-D split: 2 x 3 per device
        "odd": jax.ShapeDtypeStruct((128,), jnp.bfloat16),  # 2 of 128 on each
        "norm": jax.ShapeDtypeStruct((24,), jnp.float32),  # replicated
    }
    spec = {"w": P("data", "model"), "odd": P("data"), "norm": P()}
    table = describe(shapes, mesh, spec)
    rows = by_path(table)
    assert rows["w"].bytes_per_device == 2 * 3 * 4
    assert rows["odd"].bytes_per_device == 2 * 2
    assert rows["norm"].bytes_per_device == 24 * 4
    assert table.bytes_per_device == dict.fromkeys(range(512), 24 + 4 + 96)
    assert table.max_bytes_per_device == 124
    assert "Each of the 512 devices holds 124 B." in str(table)
    assert [r.path for r in table.unsharded] == ["norm"]


def test_abstract_mesh_plans_as_a_concrete_one() -> None:
    model = eqx.filter_eval_shape(lambda k: eqx.nn.MLP(8, 8, 32, 2, key=k), jax.random.key(0))
    concrete = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    abstract = _compat.abstract_mesh((2, 4), ("data", "model"))
    rule = path_rules([(r".*weight", P("model", "data")), (r".*", P())])
    planned = [
        [s.spec for s in jax.tree.leaves(eqxshard.filter_shardings(model, mesh, rule))]
        for mesh in (concrete, abstract)
    ]
    assert planned[0] == planned[1]
    sizes = [describe(model, mesh, rule) for mesh in (concrete, abstract)]
    assert [r.bytes_per_device for r in sizes[0].rows] == [
        r.bytes_per_device for r in sizes[1].rows
    ]
    assert sizes[0].max_bytes_per_device == sizes[1].max_bytes_per_device


VOCAB, WIDTH, HIDDEN, HEADS, DEPTH = 32000, 4096, 11008, 32, 32


class Block(eqx.Module):
    attention_norm: eqx.nn.RMSNorm
    attention: eqx.nn.MultiheadAttention
    mlp_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.attention_norm = eqx.nn.RMSNorm(WIDTH, use_bias=False)
        self.attention = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=k1)
        self.mlp_norm = eqx.nn.RMSNorm(WIDTH, use_bias=False)
        self.gate = eqx.nn.Linear(WIDTH, HIDDEN, use_bias=False, key=k2)
        self.up = eqx.nn.Linear(WIDTH, HIDDEN, use_bias=False, key=k3)
        self.down = eqx.nn.Linear(HIDDEN, WIDTH, use_bias=False, key=k4)


class Decoder(eqx.Module):
    embed: eqx.nn.Embedding
    layers: list[Block]
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, DEPTH + 2)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=keys[0])
        self.layers = [Block(k) for k in keys[2:]]
        self.norm = eqx.nn.RMSNorm(WIDTH, use_bias=False)
        self.head = eqx.nn.Linear(WIDTH, VOCAB, use_bias=False, key=keys[1])


def test_7b_decoder_sizes_equal_a_hand_computation() -> None:
    """The figures of docs/sizing.md: FSDP x tensor parallel on 8, 64 and 512 devices."""
    model = eqx.filter_eval_shape(Decoder, jax.random.key(0))
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(optax.adam(1e-3).init, params)
    rule = path_rules([
        (r".*embed\.weight", P("model", "data")),
        (r".*(query_proj|key_proj|value_proj|gate|up)\.weight", P("model", "data")),
        (r".*(output_proj|down)\.weight", P("data", "model")),
        (r".*head\.weight", P("model", "data")),
        (r".*", P()),
    ])  # fmt: skip
    # By hand: embedding and head (vocab x width), per block 4 attention projections
    # (width x width) and 3 MLP weights (width x hidden), all split over every device;
    # 2 norms per block and a final one (width each), replicated.
    split = 2 * VOCAB * WIDTH + DEPTH * (4 * WIDTH * WIDTH + 3 * WIDTH * HIDDEN)
    norms = (2 * DEPTH + 1) * WIDTH
    assert split + norms == 6_738_415_616
    for devices in (8, 64, 512):
        mesh = _compat.abstract_mesh((devices // 8, 8), ("data", "model"))
        by_hand = 4 * split // devices + 4 * norms  # float32, every split dim divides
        assert describe(params, mesh, rule).max_bytes_per_device == by_hand
        # Adam: mu and nu like the parameters, and a replicated int32 step count.
        assert describe(opt_state, mesh, rule).max_bytes_per_device == 2 * by_hand + 4
        # Parameters, gradients, mu and nu fit in 80 GB on each of these meshes.
        assert 4 * by_hand + 4 < 80 * 10**9
    assert 4 * 4 * (split + norms) > 80 * 10**9  # ... and do not without sharding


def test_offloaded_leaves_count_as_host_memory_not_device() -> None:
    """An optimiser state in pinned host memory (as a `Plan` that offloads it places it)
    is host bytes: the devices hold the parameters only."""
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    params = eqxshard.filter_shard(
        {"w": jnp.ones((64, 16)), "b": jnp.ones((16,))}, mesh, {"w": P("data"), "b": P()}
    )
    state = eqxshard.filter_put(optax.adam(1e-3).init(params), memory_kind="pinned_host")
    table = describe({"params": params, "opt_state": state})
    rows = by_path(table)
    assert rows["opt_state.0.mu.w"].memory_kind == "pinned_host"
    assert rows["opt_state.0.mu.w"].spec == "P('data') in pinned_host"
    assert rows["params.w"].memory_kind == "device" and rows["params.w"].spec == "P('data')"
    device = 8 * 16 * 4 + 16 * 4  # a row block of w, and all of b
    assert set(table.bytes_per_device.values()) == {device}
    host = table.host_bytes_per_device
    assert set(host) == set(mesh.devices.flat)
    assert host[jax.devices()[1]] == 2 * device  # mu and nu, each like the parameters
    assert table.parts["opt_state"] == 0 and table.parts["params"] == device
    assert "In host memory (offloaded, not counted above): " in str(table)
    # Nothing offloaded: no host bytes, no host line.
    assert describe(params).host_bytes_per_device == {}
    assert "host memory" not in str(describe(params))
