"""`auto_plan` weighs a stage axis on meshes larger than `compile_limit` too: scaled from a
compile on a smaller stage mesh (the stage axis kept, `data` and `fsdp` shrunk) by the rule
the plain meshes use, and compiled only where a floor of its step time can beat the
fastest layout without stages."""

from __future__ import annotations

from typing import Any

import jax
import pytest
import stacked_decoder as sd
from helpers import compiled_total

import eqxshard
from eqxshard._plans.auto import links
from eqxshard._plans.auto.dimensions.stage import scaled
from eqxshard._plans.auto.layout import Layout
from eqxshard._plans.auto.measure.jobs import Job
from eqxshard._plans.auto.scale.extrapolate import reduced_shape

SLOW = eqxshard.links.Link(bandwidth=1e8, latency=1e-3)
MEDIUM = eqxshard.links.Link(bandwidth=1e9, latency=1e-5)
# The scaled bytes per device of a stage mesh against a compile of it: with `data` shrunk
# to 1 on the smaller mesh, the gradients' all-reduce over it is added with a buffer of
# their size, which XLA does not always allocate: the estimate is then high by up to the
# gradients' bytes (8.7% of this tiny step, 41 KiB), never low.
TOLERANCE = 0.10


def _make(key):
    return sd.make(key, width=16, hidden=64, layers=4)


@pytest.fixture(scope="module")
def plan():
    # `data` is the fastest of the other axes, and slower than `stage`: data parallel is
    # the fastest layout without stages, and a stage x data mesh (half the gradients to
    # all-reduce over `data`) beats it. Four devices, compiled on at most two: every mesh
    # is scaled, and four stages, or two with fsdp, cannot be compiled at all.
    links = {"data": MEDIUM, "fsdp": SLOW, "model": SLOW}
    options: dict[str, Any] = dict(
        devices=4, budget="1GiB", optimizer=sd.OPTIMIZER, progress=False, links=links
    )
    model = _make(jax.random.key(0))
    return eqxshard.auto_plan(
        sd.step, model, sd.shapes(batch=16, tokens=4), compile_limit=2, **options
    )


@pytest.mark.heavy
def test_stage_meshes_above_compile_limit_are_scaled_from_smaller_stage_meshes(plan):
    rows = [c for c in plan.table if c.pipeline is not None and c.time is not None]
    assert [c.mesh_shape for c in rows] == [{"stage": 2, "data": 2}]
    for c in rows:
        assert c.estimated and c.measured_on.startswith("estimated from a compile on stage=2")
        assert "bubble" in c.reason
    # Four stages, or two with fsdp (kept at 2 to show its collectives), need a compile
    # on four devices: over the limit, rows that say so.
    for shape in ({"stage": 4}, {"stage": 2, "fsdp": 2}):
        rows = [c for c in plan.table if c.mesh_shape == shape]
        assert rows and all(c.time is None for c in rows)
        assert any("4 devices, over `compile_limit` = 2" in c.reason for c in rows)


@pytest.mark.heavy
def test_the_scaled_bytes_of_the_chosen_stage_plan_are_those_of_its_compile(plan):
    chosen = plan.chosen
    assert chosen.pipeline is not None and chosen.estimated
    model, state = plan.init(_make, sd.OPTIMIZER)(jax.random.key(0))
    compiled = plan.jit(sd.step).lower(model, state, sd.data(batch=16, tokens=4)).compile()
    total = compiled_total(compiled.memory_analysis())
    assert total <= chosen.total_bytes <= (1 + TOLERANCE) * total
    assert chosen.total_bytes - total <= chosen.bytes["gradients"]


def test_reduced_shape_keeps_the_stage_axis():
    assert reduced_shape({"stage": 4, "data": 8, "fsdp": 16}, 8) == {
        "stage": 4,
        "data": 1,
        "fsdp": 2,
    }
    assert reduced_shape({"stage": 8, "data": 64}, 8) == {"stage": 8, "data": 1}
    # Every mesh of two stages with fsdp and model shrinks to the same one, far below 64.
    for data, fsdp, model in ((4, 64, 4), (1, 8, 128), (16, 16, 4)):
        shape = {"stage": 2, "data": data, "fsdp": fsdp, "model": model}
        assert reduced_shape(shape, 64) == {"stage": 2, "data": 1, "fsdp": 2, "model": 2}


def _job(shape, gradients):
    layout = Layout("PP x DP", shape, None, pipeline=(4, 1))
    return Job(layout, {"parameters": gradients, "gradients": gradients})


def test_a_scaled_stage_mesh_slower_by_its_floor_is_not_compiled():
    axes = {"data": links.LINKS["inter_node"], "stage": links.LINKS["intra_node"]}
    flops, n, fps = 8e12, 64, 1e12  # 0.125 s of compute a device; bubble 3/7 on 4 stages
    big = _job({"stage": 4, "data": 16}, 2**32)  # 0.16 s of all-reduce over `inter_node`
    small = _job({"stage": 4, "data": 16}, 2**10)
    nodata = _job({"stage": 4, "fsdp": 16}, 2**30)
    low = scaled.floor(small, flops, n, fps, axes)
    assert 0.125 / (1 - 3 / 7) < low < 0.125 / (1 - 3 / 7) + 0.01
    best = low * 1.5
    by_mesh = {repr(j.layout.shape): axes for j in (big, small, nodata)}
    kept, rows = scaled.worth(
        [big, small, nodata], best=best, flops=flops, n=n, flops_per_second=fps, links=by_mesh
    )
    assert kept == [small, nodata]
    (row,) = rows
    assert row.time is None and row.pipeline == {"axis": "stage", "microbatches": 4, "repeats": 1}
    assert row.reason.startswith("not compiled: dominated, at least")
    assert "slower than" in row.reason and "without stages that fits" in row.reason
    kept, rows = scaled.worth(
        [big], best=None, flops=flops, n=n, flops_per_second=fps, links=by_mesh
    )
    assert kept == [big] and rows == []


def test_scaled_stage_meshes_are_weighed_with_the_fastest_plain_layouts_axes():
    def layout(shape):
        return Layout("PP", shape, None, pipeline=(4, 1))

    same = layout({"stage": 2, "data": 128, "model": 2})
    other_size = layout({"stage": 2, "data": 64, "model": 4})
    other_axes = layout({"stage": 2, "data": 64, "fsdp": 4})
    fastest = {"data": 256, "model": 2}
    kept, rows = scaled.like_fastest([same, other_size, other_axes], fastest)
    assert kept == [same] and len(rows) == 2
    assert all("with the axes of the fastest layout" in r.reason for r in rows)
    assert "(data x model=2)" in rows[0].reason and rows[0].time is None
    kept, rows = scaled.like_fastest([same, other_axes], None)  # none fits: all
    assert kept == [same, other_axes] and rows == []


def test_a_mesh_left_out_whole_has_one_row_not_one_per_schedule():
    def row(shape, why):
        layout = Layout("PP", shape, None, pipeline=(4, 1))
        return scaled.not_compiled(layout, why)

    schedules = [row({"stage": 2, "data": 4}, "dominated schedule"), row({"stage": 4}, "other")]
    whole = [row({"stage": 2, "data": 4}, "left out")]
    assert [r.reason for r in scaled.instead(schedules, whole)] == ["other", "left out"]
