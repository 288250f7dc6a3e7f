"""`auto_plan` puts tensor parallelism inside pipeline stages: `stage x model` meshes are
candidates for a model with tensor-parallel weights in its `Stacked` layers, and a plan
that chooses one runs as the table says and trains as one device does."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest
import stacked_decoder as sd
from helpers import compiled_total
from jax.sharding import PartitionSpec as P

import eqxshard

SLOW = eqxshard.links.Link(bandwidth=1e8, latency=1e-3)
MEDIUM = eqxshard.links.Link(bandwidth=1e9, latency=1e-5)


def _make(key):
    # The residual width is the input size of the first `Linear` (`embed`, 32 -> 32): the
    # blocks' `up` (32 -> 64) splits on its output dim, `down` (64 -> 32) on its input.
    return sd.make(key, d=32, width=32, hidden=64, layers=2)


@pytest.mark.heavy
def test_a_stage_x_model_plan_runs_as_its_table_says_and_trains_as_one_device():
    # Data and fsdp over slow links, `model` slower than `stage`: two stages (two layers
    # allow no more) with their weights split over `model` are fastest.
    links = {"data": SLOW, "fsdp": SLOW, "model": MEDIUM}
    options: dict[str, Any] = dict(
        devices=4, budget="1GiB", optimizer=sd.OPTIMIZER, progress=False, links=links
    )
    model = _make(jax.random.key(0))
    plan = eqxshard.auto_plan(sd.step, model, sd.shapes(batch=8, tokens=4, d=32), **options)
    chosen = plan.chosen
    assert chosen.mesh_shape == {"stage": 2, "model": 2} and chosen.name == "PP x TP"
    assert plan.pipeline is not None and plan.pipeline.axis == "stage"
    built, opt_state = plan.init(_make, sd.OPTIMIZER)(jax.random.key(0))
    up = built.blocks.blocks.up.weight.sharding.spec
    down = built.blocks.blocks.down.weight.sharding.spec
    assert up == P("stage", "model", None) and down == P("stage", None, "model")
    batch = sd.data(batch=8, tokens=4, d=32)
    train_step = plan.jit(sd.step)
    compiled = train_step.lower(built, opt_state, batch).compile()
    total = compiled_total(compiled.memory_analysis())
    assert chosen.total_bytes is not None
    assert abs(total - chosen.total_bytes) <= 0.01 * total
    one = _make(jax.random.key(0))
    one_state = sd.OPTIMIZER.init(eqx.filter(one, eqx.is_array))
    one_step = eqx.filter_jit(sd.step)
    for _ in range(2):
        built, opt_state, loss = train_step(built, opt_state, batch)
        one, one_state, one_loss = one_step(one, one_state, batch)
        np.testing.assert_allclose(loss, one_loss, rtol=1e-5)
