"""The pictures of `describe`: a layout grid per leaf and per-device bars, as HTML (notebooks)
and through rich (terminals), on 1-D, 2-D and mixed meshes and for abstract trees."""

from __future__ import annotations

import io
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from rich.console import Console

import eqxshard
from eqxshard._plans.describe_view import layout_grid


def tree() -> dict:
    return {"w": jnp.ones((16, 8)), "b": jnp.ones((8,)), "name": "static"}


def mesh_1d():
    return jax.make_mesh((8,), ("data",))


def mesh_2d():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def mesh_mixed():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))


def rich_text(table) -> str:
    console = Console(file=io.StringIO(), width=160, color_system="truecolor")
    console.print(table)
    return console.file.getvalue()  # type: ignore[attr-defined]


CASES = {
    "1d": (mesh_1d, {"w": P("data"), "b": P()}, {"w": (1, 8), "b": (1, 8)}, {"w": 8, "b": 1}),
    "2d": (
        mesh_2d,
        {"w": P("data", "model"), "b": P("model")},
        {"w": (2, 4), "b": (2, 4)},
        {"w": 8, "b": 4},
    ),
    "mixed": (
        mesh_mixed,
        {"w": P("model"), "b": P()},
        {"w": (2, 4), "b": (2, 4)},
        {"w": 4, "b": 1},
    ),
}


@pytest.mark.parametrize("abstract", [False, True], ids=["concrete", "abstract"])
@pytest.mark.parametrize("case", list(CASES))
def test_grids_bars_html_and_rich(case: str, abstract: bool):
    make, specs, shapes, blocks = CASES[case]
    mesh = make()
    t = eqx.filter_eval_shape(tree) if abstract else tree()
    table = eqxshard.describe(t, mesh, {**specs, "name": None})
    for row in table.rows:
        grid = layout_grid(row.shape, row.sharding)
        assert grid is not None and grid.shape == shapes[row.path], row
        assert len(np.unique(grid)) == blocks[row.path], (row.path, grid)
    page = table._repr_html_()
    assert page.count("<svg") == 2 and page.count("<rect") == 16
    assert len(re.findall(r"cpu:\d+</span>", page)) == 8  # one bar per device
    assert "<table" in page and "Bytes per device" in page
    text = rich_text(table)
    assert "█" in text and "bytes per device" in text
    assert all(f"cpu:{i}" in text for i in range(8))
    assert "\x1b[" in text  # coloured


def test_grid_colours_follow_the_blocks():
    mesh = mesh_2d()
    table = eqxshard.describe(tree(), mesh, {"w": P("data"), "b": P(), "name": None})
    w = next(r for r in table.rows if r.path == "w")
    # split over "data" only: each row of the mesh holds one block, replicated across "model"
    assert layout_grid(w.shape, w.sharding).tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]  # type: ignore[union-attr]


def test_not_placed_and_single_device_leaves():
    placed = {"a": jax.device_put(jnp.ones(4), jax.devices()[3]), "h": np.ones(3)}
    table = eqxshard.describe(placed)
    rows = {r.path: r for r in table.rows}
    assert layout_grid(rows["h"].shape, rows["h"].sharding) is None
    assert layout_grid(rows["a"].shape, rows["a"].sharding).tolist() == [[0]]  # type: ignore[union-attr]
    page = table._repr_html_()
    assert page.count("<svg") == 1 and "cpu:3" in page
    assert "cpu:3" in rich_text(table)


def test_abstract_mesh_has_no_grid_but_renders():
    abstract_mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    sharding = NamedSharding(abstract_mesh, P("data"))
    row_table = eqxshard.describe(jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=sharding))
    assert all(layout_grid(r.shape, r.sharding) is None for r in row_table.rows)
    assert "<table" in row_table._repr_html_()
    assert "P('data'" in rich_text(row_table)
