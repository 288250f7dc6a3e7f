"""`auto_plan`'s context dimension: a long sequence at batch 1 whose budget only a split
sequence meets gets a `context` axis, and `plan.jit(step)` fits by its compile with one
device's loss; a generous budget gets none."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqxshard
from eqxshard._sequence.parallel import ContextParallelAttention

T, E, VOCAB = 1024, 16, 16
OPTIMISER = optax.sgd(1e-2)


class Tiny(eqx.Module):
    embedding: eqx.nn.Embedding
    attention: eqx.nn.MultiheadAttention
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(VOCAB, E, key=keys[0])
        self.attention = eqx.nn.MultiheadAttention(4, E, key=keys[1])
        self.head = eqx.nn.Linear(E, VOCAB, key=keys[2])

    def __call__(self, tokens):
        x = jax.vmap(self.embedding)(tokens)
        x = x + self.attention(x, x, x)
        return jax.vmap(self.head)(x)


def step(model, opt_state, tokens):
    def loss(model):
        logits = jax.vmap(model)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    value, grads = eqx.filter_value_and_grad(loss)(model)
    updates, opt_state = OPTIMISER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value


@pytest.fixture(scope="module")
def searched():
    """One search per budget (the second reuses the first's compiles)."""
    model = Tiny(jax.random.key(0))
    batch = jax.ShapeDtypeStruct((1, T), jnp.int32)
    plan = lambda budget: eqxshard.auto_plan(
        step, model, batch, devices=4, budget=budget, optimizer=OPTIMISER, progress=False
    )
    return model, plan("8MiB"), plan("1GiB")


def test_a_budget_only_a_split_sequence_meets_gets_a_context_axis(searched):
    model, plan, _ = searched
    assert dict(plan.mesh.shape) == {"context": 4}
    assert plan.context == {"axis": "context", "strategy": "ring"}
    assert plan.batch_spec == P(None, "context")
    row = plan.chosen
    assert row.context == plan.context and row.fits
    assert "sequence split 4 ways over `context` (ring)" in row.reason
    assert "less than the smallest unsplit layout" in row.reason
    assert "keys and values passed round send" in row.reason
    assert row.collectives["collective-permute"] > 0
    left_out = [c for c in plan.table if c.name == "DP x context"]
    assert [c.mesh_shape for c in left_out] == [{"data": 2, "context": 2}]
    assert "the batch of 1 does not split over 2 devices (data)" in left_out[0].reason
    assert eval(repr(plan), {"Plan": eqxshard.Plan, "P": P, **vars(eqxshard)}) == plan

    tokens = jax.random.randint(jax.random.key(1), (1, T), 0, VOCAB)
    state = OPTIMISER.init(eqx.filter(model, eqx.is_array))
    split, split_state, laid_out = plan.shard(model, state, tokens)
    assert isinstance(split.attention, ContextParallelAttention)
    assert isinstance(plan.apply(model).attention, ContextParallelAttention)
    born, _ = plan.init(Tiny, OPTIMISER)(jax.random.key(0))
    assert isinstance(born.attention, ContextParallelAttention)
    assert born.attention.mesh is plan.mesh
    train = plan.jit(step, donate=False)
    memory = train.lower(split, split_state, laid_out).compile().memory_analysis()
    used = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    assert used - memory.alias_size_in_bytes <= plan.budget
    new, _, loss = train(split, split_state, laid_out)
    want_model, _, want = eqx.filter_jit(step)(model, state, tokens)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    got, want_leaves = (jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (new, want_model))
    for a, b in zip(got, want_leaves, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_generous_budget_gets_no_context_axis(searched):
    _, tight, plan = searched
    assert plan.context is None and "context" not in plan.mesh.shape
    assert "context=" not in repr(plan)
    rows = [c for c in plan.table if c.context is not None and c.time is not None]
    assert rows and all(c.fits and c.rank > 1 for c in rows)  # weighed, slower
    assert tight.chosen.total_bytes < min(
        c.total_bytes for c in tight.table if c.context is None and c.total_bytes
    )


@pytest.mark.parametrize(
    "context", ["ring", {"axis": "context"}, {"axis": "context", "strategy": "tree"}]
)
def test_a_bad_plan_context_is_a_clear_error(context):
    with pytest.raises(ValueError, match=r"`Plan` takes `context` as None or a dict"):
        eqxshard.Plan({"context": 4}, P(), P(None, "context"), context=context)


def test_the_context_meshes_and_the_batch_spec_on_them():
    from eqxshard._plans.auto.dimensions import context

    assert context.shapes(8, 4, 64) == [
        ({"data": 4, "context": 2}, ""),
        ({"data": 2, "context": 4}, ""),
        ({"context": 8}, ""),
    ]
    assert context.shapes(4, 1, 6) == [
        ({"data": 2, "context": 2}, "the batch of 1 does not split over 2 devices (data)"),
        ({"context": 4}, "the sequence of 6 does not split over 4 devices (context)"),
    ]
    assert context.sequence_spec({"data": 2, "context": 4}) == P("data", "context")
    assert context.sequence_spec({"context": 4}) == P(None, "context")
    assert context.sequence_spec({"data": 8}) == P("data")
