"""`auto_plan` keeps the optimiser state in pinned host memory when only that fits: chosen
for a tight budget (the compiled `plan.jit(step)` needs what the table says in device
memory, and trains like one device), never for a generous one."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import compiled_total

import eqxshard
from eqxshard._plans.auto.dimensions import offload

pytestmark = pytest.mark.skipif(
    not offload.supported(jax.devices()),
    reason="this JAX cannot move memory kinds inside jit on this backend (jax < 0.8 on CPU)",
)

OPTIMIZER = optax.adamw(1e-2)
BATCH = (jax.ShapeDtypeStruct((16, 128), jnp.float32),) * 2
# On 2 devices every layout needs over 500 KiB per device with AdamW's state on the
# device, and under 300 KiB with it in host memory.
TIGHT = "450KiB"


def make_model(key):
    return eqx.nn.MLP(128, 128, 256, 1, key=key)


def step(model, opt_state, batch):
    x, y = batch
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def auto_plan(budget, **kwargs):
    options: dict[str, Any] = dict(devices=2, optimizer=OPTIMIZER, progress=False)
    model = make_model(jax.random.key(0))
    return eqxshard.auto_plan(step, model, BATCH, budget=budget, **(options | kwargs))


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 128)).astype(np.float32)
    return x, np.tanh(x[:, ::-1]).copy()


def _shard_bytes(tree) -> int:
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    )


def test_a_generous_budget_keeps_the_state_on_the_device():
    plan = auto_plan("64MiB")
    assert plan.offload == () and plan.chosen.offload == ()
    # Every layout fits without offload, which costs host traffic: none is compiled.
    assert not [c for c in plan.table if c.name.endswith(" + offload")]


def test_a_tight_budget_offloads_and_the_compiled_step_agrees():
    plan = auto_plan(TIGHT)
    chosen = plan.chosen
    assert plan.offload == ("optimizer state",) == chosen.offload
    assert chosen.name.endswith(" + offload") and chosen.bytes["optimizer state"] == 0
    assert (
        "optimiser state in host memory: " in chosen.reason and "of PCIe per step" in chosen.reason
    )
    host = eqxshard.links.LINKS["host"]
    assert chosen.host_time == pytest.approx(
        2 * (host.latency + chosen.host_bytes / host.bandwidth)
    )
    assert chosen.communication_time is not None and chosen.compute_time is not None
    assert chosen.time == pytest.approx(
        chosen.communication_time + chosen.compute_time + chosen.host_time
    )
    # Without offload nothing fits: every other layout is over budget.
    assert all(not c.fits for c in plan.table if not c.offload)
    model, opt_state = plan.init(make_model, OPTIMIZER)(jax.random.key(0))
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(opt_state)}
    assert kinds == {"pinned_host"}
    assert _shard_bytes(opt_state) == chosen.host_bytes
    train_step = plan.jit(step)
    compiled = train_step.lower(model, opt_state, _data()).compile()
    m = compiled.memory_analysis()
    everything = compiled_total(m)
    # The state stays in host memory (memory space 5) as the step's argument and output.
    header = compiled.as_text().split("\n", 1)[0]
    assert header.count("S(5)") == 2 * len(jax.tree.leaves(opt_state))
    # On CPU, host and device memory are one and `memory_analysis` counts both: the
    # device's share is the rest.
    device = everything - (m.host_argument_size_in_bytes or _shard_bytes(opt_state))
    assert abs(device - (chosen.total_bytes or 0)) <= 0.01 * device
    assert device <= plan.budget
    # It trains like one device, and the state comes back to host memory each step.
    one_model = make_model(jax.random.key(0))
    one_state = OPTIMIZER.init(eqx.filter(one_model, eqx.is_array))
    one_step = eqx.filter_jit(step)
    for _ in range(3):
        model, opt_state, loss = train_step(model, opt_state, _data())
        one_model, one_state, one_loss = one_step(one_model, one_state, _data())
        np.testing.assert_allclose(loss, one_loss, rtol=1e-5)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(opt_state)} == {"pinned_host"}
    # `plan.shard` puts a state made elsewhere in host memory too.
    _, placed, _ = plan.shard(one_model, one_state)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(placed)} == {"pinned_host"}


def test_the_host_link_prices_the_offload():
    fast = auto_plan(TIGHT)
    slow = auto_plan(TIGHT, links={"host": eqxshard.links.Link(bandwidth=1e9, latency=1e-4)})
    assert slow.chosen.host_time > 10 * fast.chosen.host_time
    assert slow.chosen.communication_time == pytest.approx(fast.chosen.communication_time)


def test_a_pasted_offload_plan_offloads():
    plan = auto_plan(TIGHT)
    names = {"Plan": eqxshard.Plan, "P": jax.sharding.PartitionSpec}
    names |= {"path_rules": eqxshard.path_rules, "fsdp": eqxshard.fsdp}
    pasted = eval(repr(plan), names)
    assert pasted == plan and pasted.offload == ("optimizer state",)
    model, opt_state = pasted.init(make_model, OPTIMIZER)(jax.random.key(0))
    with pytest.raises(TypeError, match=r"offloaded takes `model` and `opt_state` as positional"):
        pasted.jit(step)(model=model, opt_state=opt_state, batch=_data())
    _, opt_state, loss = pasted.jit(step)(model, opt_state, _data())
    assert np.isfinite(loss)


def test_offload_that_cannot_beat_a_fitting_layout_is_not_compiled():
    # On 4 devices, TP fits 400 KiB; every layout over it would need the state's trips
    # over PCIe on top of its own time, which is already slower: none is compiled.
    plan = auto_plan("400KiB", devices=4)
    assert plan.offload == () and plan.chosen.fits
    rows = [c for c in plan.table if c.offload]
    assert rows and all(c.time is None and c.measured_on == "not compiled" for c in rows)
    assert all(c.reason.startswith("not compiled: dominated, at least") for c in rows)
    assert all("slower than" in c.reason and "of a layout that fits" in c.reason for c in rows)
