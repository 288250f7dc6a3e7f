"""`describe`: the per-leaf, per-device table of a plan or a placed tree (eqxshard/_describe.py)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MESH_KINDS, make_mesh
from jax.sharding import PartitionSpec as P

import eqxshard
from eqxshard._describe import ShardingTable, describe, format_bytes
from eqxshard._fsdp import fsdp
from eqxshard._rules import path_rules


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
