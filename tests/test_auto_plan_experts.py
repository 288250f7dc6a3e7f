"""`auto_plan`'s experts dimension: a model holding `Experts` whose experts and optimiser
state fit no device replicated gets an `expert` axis, and `plan.jit(step)` fits by its
compile with one device's loss; a generous budget picks the fastest row by its own
figures; `exclude=("experts",)` and a model without `Experts` get no expert rows."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import MoELayer
from jax.sharding import PartitionSpec as P

import eqxshard

# The hidden dim 255 divides by no mesh size, so tensor parallelism cannot split the
# experts, and each expert leaf (8 x 255 x 8) stays below `fsdp`'s `min_size`: only an
# `expert` axis splits them.
D, HIDDEN, E, N = 8, 255, 8, 32
OPTIMISER = optax.adam(1e-2)
EXPERT_BYTES = 4 * E * (2 * D * HIDDEN + HIDDEN + D)  # float32 weights and biases


def MoE(key, axis: str | None = "expert") -> MoELayer:
    return MoELayer(key, width=D, hidden=HIDDEN, experts=E, axis=axis)


def step(model, opt_state, batch):
    x, y = batch

    def loss(model):
        return jnp.mean((model(x) - y) ** 2)

    value, grads = eqx.filter_value_and_grad(loss)(model)
    updates, opt_state = OPTIMISER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value


BATCH = (jax.ShapeDtypeStruct((N, D), jnp.float32),) * 2


@pytest.fixture(scope="module")
def model():
    return eqx.filter_jit(MoE)(jax.random.key(0))


@pytest.fixture(scope="module")
def searched(model):
    """One search per budget (the later ones reuse the first's compiles)."""

    def plan(budget, **options):
        return eqxshard.auto_plan(
            step,
            model,
            BATCH,
            devices=4,
            budget=budget,
            optimizer=OPTIMISER,
            progress=False,
            cache_dir=False,
            **options,
        )

    return plan


def test_experts_that_fit_no_device_replicated_get_an_expert_axis(model, searched):
    budget = 500 * 1024
    # The experts, their gradients and Adam's two moments, replicated, exceed the budget.
    assert 4 * EXPERT_BYTES > budget
    plan = searched(budget)
    assert plan.mesh.shape["expert"] > 1
    assert plan.experts == {"axis": "expert"} and plan.chosen.experts == plan.experts
    assert repr(plan.rules).startswith("experts(axis='expert')")
    row = plan.chosen
    assert row.fits and row.collectives["all-to-all"] > 0
    assert f"experts split {plan.mesh.shape['expert']} ways over `expert`" in row.reason
    assert "less than the smallest unsplit layout" in row.reason
    assert "the dispatch's all-to-alls send" in row.reason
    # Without an expert axis only the optimiser state in host memory fits, and is slower.
    unsplit = [c for c in plan.table if "expert" not in c.mesh_shape]
    assert all(c.offload for c in unsplit if c.fits) and all(c.rank > 1 for c in unsplit)
    assert eval(repr(plan), {"Plan": eqxshard.Plan, "P": P, **vars(eqxshard)}) == plan

    x = jax.random.normal(jax.random.key(1), (N, D))
    batch = (x, jnp.sin(x))
    state = OPTIMISER.init(eqx.filter(model, eqx.is_array))
    split, split_state, laid_out = plan.shard(model, state, batch)
    assert split.experts.axis == "expert" and split.experts.mesh is plan.mesh
    weight = split.experts.expert_blocks.layers[0].weight
    assert weight.sharding.spec[0] == "expert"
    mu = split_state[0].mu.experts  # Adam's first moment, laid out like the experts
    assert mu.axis == "expert" and mu.expert_blocks.layers[0].weight.sharding.spec[0] == "expert"
    born, _ = plan.init(MoE, OPTIMISER)(jax.random.key(0))
    assert born.experts.axis == "expert" and born.experts.mesh is plan.mesh
    train = plan.jit(step, donate=False)
    memory = train.lower(split, split_state, laid_out).compile().memory_analysis()
    used = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    assert used - memory.alias_size_in_bytes <= plan.budget
    new, _, loss = train(split, split_state, laid_out)
    # One device: the same weights, the experts unsplit.
    reference = eqx.filter_jit(MoE)(jax.random.key(0), axis=None)
    reference_state = OPTIMISER.init(eqx.filter(reference, eqx.is_array))
    want_model, _, want = eqx.filter_jit(step)(reference, reference_state, batch)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    got, want_leaves = (jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (new, want_model))
    for a, b in zip(got, want_leaves, strict=True):  # Adam's step scales tiny gradients up
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_a_generous_budget_picks_the_fastest_row_by_its_own_figures(searched):
    plan = searched("1GiB")
    fitting = [c for c in plan.table if c.fits]
    assert any("expert" in c.mesh_shape for c in fitting)  # weighed
    assert any("expert" not in c.mesh_shape for c in fitting)
    assert plan.chosen.time == min(c.time for c in fitting)
    split = "expert" in plan.mesh.shape
    assert plan.chosen.experts == ({"axis": "expert"} if split else None)
    assert plan.experts == (plan.chosen.experts if split else {"axis": None})


def test_excluding_experts_leaves_them_out_and_runs_them_unsplit(model, searched):
    plan = searched("1GiB", exclude=("experts",))
    assert not [c for c in plan.table if "expert" in c.mesh_shape or c.experts]
    # The plan runs the model's `Experts` unsplit, as every layout was measured.
    assert plan.experts == {"axis": None} and "experts={'axis': None}" in repr(plan)
    applied = plan.apply(model)
    assert applied.experts.axis is None and applied.experts.mesh is None
    x = jax.random.normal(jax.random.key(1), (N, D))
    reference = eqx.filter_jit(MoE)(jax.random.key(0), axis=None)
    np.testing.assert_allclose(
        eqx.filter_jit(lambda m, x: m(x))(applied, x), reference(x), rtol=1e-5, atol=1e-6
    )


def test_a_model_without_experts_gets_no_expert_rows():
    model = eqx.nn.MLP(D, D, 16, 1, key=jax.random.key(0))

    def mlp_step(model, opt_state, x):
        value, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - x) ** 2))(
            model
        )
        params = eqx.filter(model, eqx.is_array)
        updates, opt_state = OPTIMISER.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, value

    plan = eqxshard.auto_plan(
        mlp_step,
        model,
        BATCH[0],
        devices=2,
        budget="1GiB",
        optimizer=OPTIMISER,
        progress=False,
        cache_dir=False,
    )
    assert plan.experts is None
    assert not [c for c in plan.table if "expert" in c.mesh_shape or c.experts]


@pytest.mark.parametrize("experts", ["expert", {"axis": 3}, {"axis": "expert", "size": 4}])
def test_a_bad_plan_experts_is_a_clear_error(experts):
    with pytest.raises(ValueError, match=r"`Plan` takes `experts` as None \(.*\) or a dict"):
        eqxshard.Plan({"expert": 4}, P(), P("expert"), experts=experts)


def test_the_expert_layouts():
    from eqxshard._plans.auto.dimensions import experts

    shapes = [(v.name, v.shape, why) for v, why in experts.layouts(8, {8, 16}, 32)]
    assert shapes == [
        ("DP x EP", {"data": 4, "expert": 2}, ""),
        ("FSDP x EP", {"fsdp": 4, "expert": 2}, ""),
        ("DP x EP", {"data": 2, "expert": 4}, ""),
        ("FSDP x EP", {"fsdp": 2, "expert": 4}, ""),
        ("EP", {"expert": 8}, ""),
    ]
    # 12 experts split over 2 or 4 devices only; a batch of 6 over no 4 devices.
    assert [(v.shape, why) for v, why in experts.layouts(4, {12}, 6)] == [
        ({"data": 2, "expert": 2}, "the batch of 6 does not split over 4 devices"),
        ({"fsdp": 2, "expert": 2}, "the batch of 6 does not split over 4 devices"),
        ({"expert": 4}, "the batch of 6 does not split over 4 devices"),
    ]


def test_a_plan_without_experts_leaves_a_models_experts_as_they_are(model):
    """A hand-built plan (`experts=None`) places the model and keeps its `Experts` split
    as the model says; `{"axis": None}` runs them unsplit; both give the same values."""
    rules = eqxshard.experts("expert") | P()
    kept = eqxshard.Plan({"data": 2, "expert": 4}, rules, P(("data", "expert"))).apply(model)
    assert kept.experts.axis == "expert"
    assert kept.experts.expert_blocks.layers[0].weight.sharding.spec[0] == "expert"
    plan = eqxshard.Plan({"data": 8}, P(), P("data"), experts={"axis": None})
    assert "experts unsplit" in str(plan)
    unsplit = plan.apply(model)
    assert unsplit.experts.axis is None
    x = jax.random.normal(jax.random.key(1), (N, D))
    mesh = kept.experts.expert_blocks.layers[0].weight.sharding.mesh
    with jax.set_mesh(mesh):  # the `Experts` find it there, as in a step
        split = eqx.filter_jit(lambda m, x: m(x))(kept, x)
    np.testing.assert_allclose(
        split, eqx.filter_jit(lambda m, x: m(x))(unsplit, x), rtol=1e-5, atol=1e-6
    )
