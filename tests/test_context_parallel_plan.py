"""`auto_plan`'s context dimension: a long sequence at batch 1 whose budget only a split
sequence meets gets a `context` axis, and `plan.jit(step)` fits by its compile with one
device's loss; a generous budget gets none; with wide layers, the `context` axis beside
`model` (the heads split) or beside `fsdp` (the parameters split) is the only fit."""

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


def _plan(model, batch: int, budget: str, devices: int = 4, exclude=()):
    return eqxshard.auto_plan(
        step,
        model,
        jax.ShapeDtypeStruct((batch, T), jnp.int32),
        devices=devices,
        budget=budget,
        optimizer=OPTIMISER,
        exclude=exclude,
        progress=False,
    )


def test_a_budget_only_a_split_sequence_meets_gets_a_context_axis():
    model = Tiny(jax.random.key(0))
    plan = _plan(model, 1, "8MiB")
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
    assert row.total_bytes is not None and row.total_bytes < min(
        c.total_bytes for c in plan.table if c.context is None and c.total_bytes
    )

    tokens = jax.random.randint(jax.random.key(1), (1, T), 0, VOCAB)
    state = OPTIMISER.init(eqx.filter(model, eqx.is_array))
    split, split_state, laid_out = plan.shard(model, state, tokens)
    assert isinstance(split.attention, ContextParallelAttention)
    assert isinstance(plan.apply(model).attention, ContextParallelAttention)
    born, _ = plan.init(Tiny, OPTIMISER)(jax.random.key(0))
    assert isinstance(born.attention, ContextParallelAttention)
    assert born.attention.mesh is plan.mesh
    _fits_and_matches_one_device(plan, model, tokens, split, split_state, laid_out)


def _fits_and_matches_one_device(plan, model, tokens, *placed):
    """`plan.jit(step)` fits the plan's budget by its compile and gives one device's loss
    and model, from the inputs `placed` by the plan and from the unconverted model and
    state as they are (which `plan.jit` converts: the model comes back converted)."""
    state = OPTIMISER.init(eqx.filter(model, eqx.is_array))
    train = plan.jit(step, donate=False)
    for args in (placed, (model, state, tokens)):
        memory = train.lower(*args).compile().memory_analysis()
        used = memory.argument_size_in_bytes + memory.output_size_in_bytes
        used += memory.temp_size_in_bytes - memory.alias_size_in_bytes
        assert used <= plan.budget
    want_model, _, want = eqx.filter_jit(step)(model, state, tokens)
    for args in (placed, (model, state, tokens)):
        new, _, loss = train(*args)
        assert isinstance(new.attention, ContextParallelAttention)
        np.testing.assert_allclose(loss, want, rtol=1e-5)
        got, expected = (jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (new, want_model))
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_generous_budget_gets_no_context_axis():
    """Four sequences on four devices, room to spare: one sequence per device is fastest
    (at batch 1, splitting the sequence with the heads over `model` can beat tensor
    parallelism alone: `auto_plan` chooses by the estimated time)."""
    plan = _plan(Tiny(jax.random.key(0)), 4, "1GiB")
    assert plan.context is None and "context" not in plan.mesh.shape
    assert "context=" not in repr(plan)
    rows = [c for c in plan.table if c.context is not None and c.time is not None]
    assert rows and all(c.fits and c.rank > 1 for c in rows)  # weighed, slower


@pytest.mark.parametrize(
    "context",
    [
        "ring",
        {"axis": "context"},
        {"axis": "context", "strategy": "tree"},
        {"axis": "context", "strategy": "ring", "heads_axis": 2},
    ],
)
def test_a_bad_plan_context_is_a_clear_error(context):
    with pytest.raises(ValueError, match=r"`Plan` takes `context` as None or a dict"):
        eqxshard.Plan({"context": 4}, P(), P(None, "context"), context=context)


def test_the_context_layouts_and_the_batch_spec_on_them():
    from eqxshard._plans.auto.dimensions import context

    found = context.layouts(Tiny(jax.random.key(0)), 4, 2, 64)
    assert [(c.name, c.shape, why) for c, why in found] == [
        ("TP x context", {"context": 2, "model": 2}, ""),
        ("FSDP x context", {"fsdp": 2, "context": 2}, ""),
        ("DP x context", {"data": 2, "context": 2}, ""),
        ("context", {"context": 4}, ""),
    ]
    assert [why for _, why in context.layouts(Tiny(jax.random.key(0)), 4, 1, 6)] == [
        "",
        "the batch of 1 does not split over 2 devices (fsdp)",
        "the batch of 1 does not split over 2 devices (data)",
        "the sequence of 6 does not split over 4 devices (context)",
    ]
    assert context.sequence_spec({"data": 2, "context": 4}) == P("data", "context")
    assert context.sequence_spec({"fsdp": 2, "context": 4}) == P("fsdp", "context")
    assert context.sequence_spec({"context": 4, "model": 2}) == P(None, "context")
    assert context.sequence_spec({"data": 8}) == P("data")
    assert context.options({"context": 4, "model": 2}) == {
        "axis": "context",
        "strategy": "ring",
        "heads_axis": "model",
    }


def test_plan_jit_keeps_layers_converted_already():
    """`plan.jit` converts the layers not yet converted; one converted by
    `context_parallel` with other options keeps them."""
    model = Tiny(jax.random.key(0))
    plan = eqxshard.Plan({"context": 4}, P(), P(None, "context"), context=CONTEXT)
    mine = eqxshard.context_parallel(model, strategy="all_gather", mesh=plan.mesh)
    tokens = jax.random.randint(jax.random.key(1), (1, T), 0, VOCAB)
    state = OPTIMISER.init(eqx.filter(model, eqx.is_array))
    new, _, loss = plan.jit(step, donate=False)(mine, state, tokens)
    assert new.attention.strategy == "all_gather"
    np.testing.assert_allclose(loss, eqx.filter_jit(step)(model, state, tokens)[2], rtol=1e-5)


CONTEXT = {"axis": "context", "strategy": "ring"}


class Wide(eqx.Module):
    """`Tiny` with wide layers (8 heads): parameters too many to hold whole on every
    device of a `context` axis alone."""

    embedding: eqx.nn.Embedding
    attention: eqx.nn.MultiheadAttention
    head: eqx.nn.Linear

    def __init__(self, width, key):
        keys = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(VOCAB, width, key=keys[0])
        self.attention = eqx.nn.MultiheadAttention(8, width, key=keys[1])
        self.head = eqx.nn.Linear(width, VOCAB, key=keys[2])

    __call__ = Tiny.__call__


@pytest.mark.parametrize(
    "width, batch, budget, exclude, mesh, name",
    [
        # One sequence: 4-way context with the heads over `model` (2.3 MiB less than
        # the next, 4-way context with them whole on each device).
        (768, 1, "19MiB", (), {"context": 4, "model": 2}, "TP x context"),
        # Two sequences, tensor parallelism left out: 4-way context with the parameters
        # split over `fsdp` (14 MiB less than 8-way context with them whole).
        (1024, 2, "40MiB", ("tensor",), {"fsdp": 2, "context": 4}, "FSDP x context"),
    ],
)
def test_a_context_axis_beside_model_or_fsdp_when_only_it_fits(
    width, batch, budget, exclude, mesh, name
):
    model = Wide(width, jax.random.key(0))
    plan = _plan(model, batch, budget, devices=8, exclude=exclude)
    assert dict(plan.mesh.shape) == mesh and plan.chosen.name == name
    heads = {"heads_axis": "model"} if "model" in mesh else {}
    assert plan.context == {"axis": "context", "strategy": "ring", **heads}
    assert "the only one that fits" in plan.chosen.reason
    assert "sequence split 4 ways over `context` (ring)" in plan.chosen.reason
    assert plan.chosen.collectives["collective-permute"] > 0
    tokens = jax.random.randint(jax.random.key(1), (batch, T), 0, VOCAB)
    state = OPTIMISER.init(eqx.filter(model, eqx.is_array))
    placed = plan.shard(model, state, tokens)
    assert placed[0].attention.heads_axis == heads.get("heads_axis")
    _fits_and_matches_one_device(plan, model, tokens, *placed)


class Block(eqx.Module):
    attention: eqx.nn.MultiheadAttention

    def __init__(self, key):
        self.attention = eqx.nn.MultiheadAttention(4, E, key=key)

    def __call__(self, h):
        one = lambda x: x + self.attention(x, x, x)
        return jax.vmap(one)(h) if h.ndim == 3 else one(h)


class Piped(eqx.Module):
    """Two attention layers stacked, which the stage dimension pipelines."""

    blocks: eqxshard.Stacked

    def __init__(self, key):
        self.blocks = eqxshard.Stacked(eqx.filter_vmap(Block)(jax.random.split(key, 2)))

    def __call__(self, x):
        return self.blocks(x)


def piped_step(model, opt_state, x):
    loss = lambda m: jnp.mean(jax.vmap(m)(x) ** 2)
    value, grads = eqx.filter_value_and_grad(loss)(model)
    updates, opt_state = OPTIMISER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value


def test_a_context_axis_beside_stage_is_weighed_and_its_plan_runs_as_one_device():
    model = Piped(jax.random.key(0))
    plan = eqxshard.auto_plan(
        piped_step,
        model,
        jax.ShapeDtypeStruct((4, 64, E), jnp.float32),
        devices=4,
        budget="1GiB",
        optimizer=OPTIMISER,
        progress=False,
    )
    assert any(c.pipeline for c in plan.table)  # the stage dimension weighed pipelines
    rows = [c for c in plan.table if c.name == "PP x context"]
    assert [c.mesh_shape for c in rows] == [{"stage": 2, "context": 2}]
    (row,) = rows
    assert row.time is not None and row.pipeline and row.context  # compiled, both chosen
    assert "sequence split 2 ways over `context` (ring)" in row.reason
    assert row.collectives["collective-permute"] > 0
    # The row as a plan: the pipeline with its stages' attention converted, trained as
    # on one device.
    chosen = eqxshard.Plan(
        row.mesh_shape,
        row.rules,
        P(None, "context"),
        pipeline=eqxshard.Pipeline(**row.pipeline),
        context=row.context,
    )
    x = jax.random.normal(jax.random.key(1), (4, 64, E))
    state = OPTIMISER.init(eqx.filter(model, eqx.is_array))
    split, split_state, laid_out = chosen.shard(model, state, x)
    step = chosen.jit(piped_step)
    one = eqx.filter_jit(piped_step)
    for _ in range(2):
        split, split_state, split_loss = step(split, split_state, laid_out)
        model, state, loss = one(model, state, x)
        np.testing.assert_allclose(split_loss, loss, rtol=2e-5)
