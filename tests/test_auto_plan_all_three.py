"""The plan of docs/auto_plan.md where `auto_plan` chooses pipeline stages, remat and the
optimiser state in host memory together (`docs/images/auto_plan_memory.py` builds it and
draws its chart): `plan.jit(step)` holds the table's bytes per device and trains as one
device does; and the chart shows each part per candidate, device and host."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import compiled_total

import eqxshard

SCRIPT = Path(__file__).parent.parent / "docs" / "images" / "auto_plan_memory.py"


def _script():
    spec = importlib.util.spec_from_file_location("auto_plan_memory", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shard_bytes(tree) -> int:
    """Bytes of the leaves of `tree` held by the first device."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def _row(name: str, **fields: Any) -> eqxshard.report.Candidate:
    values: dict[str, Any] = dict(
        rank=1,
        name=name,
        mesh_shape={"stage": 2},
        rules=None,
        bytes={"parameters": 100, "gradients": 100, "optimizer state": 0, "activations": 500},
        total_bytes=700,
        collectives={},
        communication_time=0.0,
        compute_time=1.0,
        time=1.0,
        fits=True,
        estimated=False,
        measured_on="compiled here",
        reason="",
    )
    return eqxshard.report.Candidate(**(values | fields))


def test_the_chart_stacks_each_part_and_what_is_in_host_memory(tmp_path):
    from jax.sharding import PartitionSpec as P

    script = _script()
    rows = [
        _row("PP + remat full + offload", host_bytes=200, offload=("optimizer state",)),
        _row("PP", rank=2, total_bytes=1100, fits=False, bytes={"activations": 1100}),
    ]
    plan = eqxshard.Plan(mesh={"stage": 2}, rules=P(), batch_spec=P(), table=rows, budget=800)
    text = script.draw(plan, tmp_path / "chart.svg")
    assert (tmp_path / "chart.svg").read_text() == text + "\n"
    for part in ("parameters", "gradients", "optimizer state", "batch", "activations"):
        assert f">{part}</text>" in text
    assert ">in host memory</text>" in text and "budget 800 B" in text
    assert text.count("<title>optimizer state in host memory: 200 B</title>") == 1
    # One bar segment per part held (three for the first row, one for the second).
    assert len(re.findall(r"<title>(parameters|gradients|activations): ", text)) == 4


@pytest.mark.heavy
def test_stages_remat_and_offload_chosen_together_run_as_planned():
    script = _script()
    plan = script.plan()
    assert plan.pipeline == eqxshard.Pipeline(axis="stage", microbatches=2, repeats=1)
    assert plan.remat == {"blocks": "full"} and plan.offload == ("optimizer state",)
    chosen = plan.chosen
    assert chosen.name == "PP + remat full + offload" and chosen.fits
    assert "optimiser state in host memory" in chosen.reason
    assert "remat full on `blocks`: without it" in chosen.reason and "bubble" in chosen.reason
    # Without offload the same remat is over budget: each choice pays.
    remat_only = next(c for c in plan.table if c.name == "PP + remat full")
    assert not remat_only.fits
    model, state = plan.init(script.make_decoder, script.optimizer)(jax.random.key(0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 32, 8)).astype(np.float32)
    batch = (x, np.tanh(x[..., ::-1]).copy())
    train_step = plan.jit(script.step)
    compiled = train_step.lower(model, state, batch).compile()
    memory = compiled.memory_analysis()
    # On CPU `memory_analysis` counts host memory too: the device's share is the rest.
    device = compiled_total(memory) - (memory.host_argument_size_in_bytes or _shard_bytes(state))
    assert abs(device - (chosen.total_bytes or 0)) <= 0.01 * device
    one = script.make_decoder(jax.random.key(0))
    one_state = script.optimizer.init(eqx.filter(one, eqx.is_array))
    one_step = eqx.filter_jit(script.step)
    for _ in range(2):
        model, state, loss = train_step(model, state, batch)
        one, one_state, one_loss = one_step(one, one_state, batch)
        np.testing.assert_allclose(loss, one_loss, rtol=1e-5)
