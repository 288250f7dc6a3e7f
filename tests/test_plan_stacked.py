"""`plan.apply` / `plan.init` / `plan.shard` configure every `eqxshard.Stacked` with the
plan's remat and pipeline choices: the configured model computes what the unconfigured one
does (values and gradients), and its programs show the remat and the pipeline."""

from __future__ import annotations

import dataclasses
import re

import equinox as eqx
import jax
import numpy as np
import pytest
import stacked_decoder as sd
from jax.sharding import PartitionSpec as P

import eqxshard

PIPELINE = eqxshard.Pipeline(axis="stage", microbatches=4)
CIRCULAR = dataclasses.replace(PIPELINE, repeats=2)


def _plan(**choices):
    rules = eqxshard.first(eqxshard.stages("stage", path=r"blocks\..*"), P())
    return eqxshard.Plan(mesh={"stage": 2, "data": 2}, rules=rules, batch_spec=P("data"), **choices)


def _in_layer_order(grads):
    """Gradients with the stack's as a list of layers: a circular stack stores its layers
    stage-major, and so are its gradients."""
    return eqx.tree_at(lambda g: g.blocks, grads, grads.blocks.to_layers())


def _remat_in_jaxpr(model, batch) -> bool:
    """Whether the loss's jaxpr has a `jax.checkpoint` (`remat2` or `checkpoint`, by JAX
    version)."""
    text = str(eqx.filter_make_jaxpr(sd.loss_fn)(model, batch)[0])
    return re.search(r"= (remat2|checkpoint)\[", text) is not None


# Under `jit`: eagerly, each op of a pipelined stack dispatches on its own (minutes).
FORWARD = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
GRAD = eqx.filter_jit(eqx.filter_grad(sd.loss_fn))


@pytest.fixture(scope="module")
def unconfigured():
    """The model as made, its outputs and gradients: computed once for every case."""
    model = sd.make(jax.random.key(0))
    batch = sd.data()
    assert not _remat_in_jaxpr(model, batch)
    return model, batch, FORWARD(model, batch[0]), _in_layer_order(GRAD(model, batch))


@pytest.mark.parametrize(
    "choices",
    [
        {"remat": {"blocks": "dots"}},
        pytest.param({"remat": {"blocks": "full"}, "pipeline": PIPELINE}, marks=pytest.mark.heavy),
        pytest.param(
            {"pipeline": dataclasses.replace(PIPELINE, repeats=2)}, marks=pytest.mark.heavy
        ),
    ],
    ids=["remat", "remat+gpipe", "circular"],
)
def test_apply_configures_the_stacks_and_computes_the_same(choices, unconfigured):
    plan = _plan(**choices)
    model, batch, out, want = unconfigured
    configured = plan.apply(model)
    stack = configured.blocks
    assert stack.remat == choices.get("remat", {}).get("blocks", "none")
    pipeline = choices.get("pipeline")
    assert stack.axis == (pipeline and pipeline.axis)
    assert stack.microbatches == (pipeline and pipeline.microbatches)
    assert stack.repeats == (pipeline.repeats if pipeline else 1)
    assert model.blocks.remat == "none" and model.blocks.axis is None  # not changed in place
    # The layer dim is split over the stages, the other leaves replicated.
    assert configured.blocks.blocks.up.weight.sharding.spec == P("stage")
    np.testing.assert_allclose(FORWARD(configured, batch[0]), out, rtol=1e-5, atol=1e-6)
    got = _in_layer_order(GRAD(configured, batch))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # What the program shows: `jax.checkpoint` around each layer (none in the model as
    # made: checked by the fixture), collective permutes between the stages.
    assert _remat_in_jaxpr(configured, batch) == ("remat" in choices)
    state = sd.OPTIMIZER.init(eqx.filter(configured, eqx.is_array))
    text = plan.jit(sd.step).lower(configured, state, batch).compile().as_text()
    assert ("collective-permute" in text) == (pipeline is not None)


@pytest.mark.heavy
def test_init_and_shard_configure_too():
    plan = _plan(remat={"blocks": "dots"}, pipeline=PIPELINE)
    model, state = plan.init(sd.make, sd.OPTIMIZER)(jax.random.key(0))
    assert model.blocks.remat == "dots" and model.blocks.axis == "stage"
    assert model.blocks.mesh is plan.mesh
    placed, _, _ = plan.shard(sd.make(jax.random.key(0)))
    assert placed.blocks.remat == "dots" and placed.blocks.microbatches == 4
    _, _, loss = plan.jit(sd.step)(model, state, sd.data())
    one = sd.make(jax.random.key(0))
    np.testing.assert_allclose(loss, sd.loss_fn(one, sd.data()), rtol=1e-5)


def test_a_plan_for_other_stacks_is_refused():
    model = sd.make(jax.random.key(0))
    with pytest.raises(ValueError, match=r"`remat` names \['layers'\].*at: 'blocks'"):
        _plan(remat={"layers": "dots"}).apply(model)
    mlp = eqx.nn.MLP(8, 8, 8, 1, key=jax.random.key(0))
    piped = eqxshard.Plan(mesh={"stage": 2}, rules=P(), batch_spec=P(), pipeline=PIPELINE)
    with pytest.raises(ValueError, match=r"plan where a `pipeline` is chosen.*at: none"):
        piped.apply(mlp)
    with pytest.raises(ValueError, match=r"`Plan.shard` got a plan where `remat` names"):
        _plan(remat={"layers": "dots"}).shard(model)
