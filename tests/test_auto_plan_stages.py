"""`auto_plan` on a model with `eqxshard.Stacked` layers: remat policies and a stage axis
are searched, pruned by arithmetic before compiling, and the chosen plan's `plan.jit(step)`
is what the table says (bytes per device within 1%) and trains as one device does."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest
import stacked_decoder as sd
from helpers import compiled_total

import eqxshard
from eqxshard._plans.auto.dimensions.remat import policies
from eqxshard._plans.auto.layout import Layout

SLOW = eqxshard.links.Link(bandwidth=1e8, latency=1e-3)


def _make(layers):
    return lambda key: sd.make(key, width=32, hidden=512, layers=layers)


def _check_runs_as_planned(plan, make):
    """`plan.jit(step)` compiles to the table's bytes per device, and trains as one device."""
    model, state = plan.init(make, sd.OPTIMIZER)(jax.random.key(0))
    batch = sd.data(batch=16, tokens=32)
    train_step = plan.jit(sd.step)
    compiled = train_step.lower(model, state, batch).compile()
    total = compiled_total(compiled.memory_analysis())
    assert abs(total - plan.chosen.total_bytes) <= 0.01 * total
    one = make(jax.random.key(0))
    one_state = sd.OPTIMIZER.init(eqx.filter(one, eqx.is_array))
    one_step = eqx.filter_jit(sd.step)
    for _ in range(2):
        model, state, loss = train_step(model, state, batch)
        one, one_state, one_loss = one_step(one, one_state, batch)
        np.testing.assert_allclose(loss, one_loss, rtol=1e-5)


@pytest.fixture(scope="module")
def tight():
    # Three layers do not split over two stages: only remat can make this model fit.
    model = _make(3)(jax.random.key(0))
    options: dict[str, Any] = dict(devices=2, budget="4MiB", optimizer=sd.OPTIMIZER, progress=False)
    return eqxshard.auto_plan(sd.step, model, sd.shapes(batch=16, tokens=32), **options)


@pytest.mark.heavy
def test_remat_makes_a_model_fit_that_no_layout_fits_without(tight):
    plain = [c for c in tight.table if not c.remat and c.pipeline is None]
    assert plain and all(not c.fits for c in plain)
    assert all(c.total_bytes is not None for c in plain)  # compiled, and over
    chosen = tight.chosen
    assert chosen.fits and chosen.remat == {"blocks": chosen.remat["blocks"]}
    assert chosen.remat["blocks"] in ("dots", "full", "offload")
    assert tight.remat == chosen.remat and tight.pipeline is None
    assert f"remat {chosen.remat['blocks']} on `blocks`: without it" in chosen.reason
    assert chosen.reason.count("to spare") == 1  # said once, not again by the remat note
    assert "without it" in chosen.reason and "more matmul flops than no remat" in chosen.reason
    # Full remat recomputes the forward pass: the step's matmul flops are higher.
    full = next(c for c in tight.table if c.remat.get("blocks") == "full" and c.time)
    assert "recomputes 17% more matmul flops than no remat" in full.reason
    _check_runs_as_planned(tight, _make(3))


def test_remat_variants_are_pruned_by_arithmetic():
    layout = Layout("DP", {"data": 2}, None)
    slow = eqxshard.report.Candidate(
        rank=0,
        name="DP",
        mesh_shape={"data": 2},
        rules=None,
        bytes={"activations": 10},
        total_bytes=10,
        collectives={},
        communication_time=1.0,
        compute_time=1.0,
        time=2.0,
        fits=False,
        estimated=False,
        measured_on="compiled here",
        reason="",
    )
    fitting = Layout("FSDP", {"fsdp": 2}, None)
    fits = eqxshard.report.Candidate(**{**slow.__dict__, "name": "FSDP", "fits": True})
    todo, pruned = policies.worth([(layout, slow), (fitting, fits)], ["blocks"], ("dots",), 1.0)
    assert todo == [] and [v.name for v, _ in pruned] == ["DP + remat dots"]
    row = policies.dominated(pruned[0][0], slow, 1.0)
    assert row.reason.startswith("not compiled: dominated, remat dots only adds to 2.00 s per step")
    assert row.remat == {"blocks": "dots"} and row.total_bytes is None
    todo, pruned = policies.worth([(layout, slow), (fitting, fits)], ["blocks"], ("dots",), 3.0)
    assert [v.name for v, _, _ in todo] == ["DP + remat dots"] and pruned == []


@pytest.mark.heavy
def test_a_generous_budget_chooses_no_remat_offload_or_stages():
    model = _make(4)(jax.random.key(0))
    options: dict[str, Any] = dict(devices=2, budget="1GiB", optimizer=sd.OPTIMIZER, progress=False)
    plan = eqxshard.auto_plan(sd.step, model, sd.shapes(batch=16, tokens=8), **options)
    assert plan.remat == {} and plan.offload == () and plan.pipeline is None
    assert any(c.pipeline is not None and c.time is not None for c in plan.table)
    assert all(not c.remat for c in plan.table)  # everything fits: remat is never tried


@pytest.mark.heavy
def test_stages_win_when_the_other_axes_are_slow():
    model = _make(4)(jax.random.key(0))
    links = {"data": SLOW, "fsdp": SLOW, "model": SLOW}
    options: dict[str, Any] = dict(devices=2, budget="1GiB", optimizer=sd.OPTIMIZER, progress=False)
    plan = eqxshard.auto_plan(
        sd.step, model, sd.shapes(batch=16, tokens=32), links=links, **options
    )
    assert plan.pipeline is not None and plan.pipeline.axis == "stage"
    assert plan.mesh.shape["stage"] == 2 and plan.remat == {}
    chosen = plan.chosen
    assert "2 stages x" in chosen.reason and "bubble" in chosen.reason
    assert "chosen because DP's all-reduces" in chosen.reason
    assert "cross links of 0.1 GB/s" in chosen.reason
    skipped = [c for c in plan.table if c.measured_on == "not compiled" and c.pipeline]
    assert skipped and all("dominated by 2 stages x" in c.reason for c in skipped)
    _check_runs_as_planned(plan, _make(4))


@pytest.mark.heavy
def test_remat_compiles_alongside_give_the_figures_of_compiles_here(tight, monkeypatch):
    """A rematerialising candidate compiled by the second process (which `auto_plan` starts
    only when compiles are slow, so on a loaded machine) is compiled as here, with constant
    folding: the same figures, not a tenth fewer bytes. The figures of compiles here are
    `tight`'s (the same model, batch and options; its step compiled here already)."""
    from eqxshard._plans.auto.measure import compile_remote, jobs

    model = _make(3)(jax.random.key(0))
    options: dict[str, Any] = dict(devices=2, budget="4MiB", optimizer=sd.OPTIMIZER, progress=False)
    shapes = sd.shapes(batch=16, tokens=32)
    here = tight
    monkeypatch.setattr(jobs, "ALONGSIDE_AFTER", 0.0)
    monkeypatch.setattr(jobs.os, "cpu_count", lambda: 2)
    started = []
    start = compile_remote.start
    monkeypatch.setattr(compile_remote, "start", lambda *a: started.append(a[1]) or start(*a))
    both = eqxshard.auto_plan(lambda *a: sd.step(*a), model, shapes, **options)
    remat_sent = [placed for batch in started for placed, _ in batch if placed.remat]
    assert remat_sent, "no rematerialising candidate was compiled alongside"

    def figures(plan):
        return [(c.name, c.remat, c.bytes, c.total_bytes, c.time) for c in plan.table]

    assert figures(both) == figures(here)
