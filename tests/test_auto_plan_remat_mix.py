"""A remat policy per `eqxshard.Stacked`: `Plan.remat` by path (or one policy for every
stack), each stack configured with its own, and `auto_plan` rematerialising only the
stacks whose activations are largest where that fits (what each stack saves read from the
step's jaxpr, the fewest that cover the excess compiled once more)."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest
import stacked_decoder as sd
from helpers import candidate_row, compiled_total, numpy_filled
from jax.sharding import PartitionSpec as P

import eqxshard
from eqxshard._plans.auto.dimensions.remat import per_stack, policies, residuals
from eqxshard._plans.auto.layout import Layout
from eqxshard._plans.auto.rank.table import nothing_fits, ranked
from eqxshard._tree import format_bytes, is_array_like

BATCH, TOKENS, WIDTH, F32 = 16, 32, 32, 4


def _args(model):
    abstract = eqx.filter_eval_shape(lambda: model)
    state = jax.eval_shape(sd.OPTIMIZER.init, eqx.filter(abstract, is_array_like))
    return abstract, state, sd.shapes(BATCH, TOKENS)


def test_saved_bytes_of_each_stack_are_its_forward_scans_residuals():
    args = _args(eqx.filter_eval_shape(sd.make_two, jax.random.key(0)))
    rows = BATCH * TOKENS * F32
    # Without remat a block keeps its input (width), and its hidden pre- and post-tanh.
    traced = residuals.RematTrace(sd.step, args)
    kept = traced.at("none")
    assert kept.device == {
        "wide": 3 * rows * (WIDTH + 2 * 512),
        "narrow": 5 * rows * (WIDTH + 2 * 64),
    }
    assert kept.host == {"wide": 0, "narrow": 0} and kept.missing == ()
    # "full" keeps each layer's input only.
    full = {"wide": 3 * rows * 2 * 512, "narrow": 5 * rows * 2 * 64}
    assert traced("full") == full
    # "offload" keeps on the device what "full" does: the matmul outputs it saves (the
    # hidden pre-tanh) are in host memory, not on the device.
    assert traced("offload") == full
    offload = traced.at("offload")
    assert offload.host == {"wide": 3 * rows * 512, "narrow": 5 * rows * 64}
    assert traced.host_bytes((("wide", "offload"), ("narrow", "offload"))) == rows * (
        3 * 512 + 5 * 64
    )
    assert traced.host_bytes((("wide", "offload"),)) == rows * 3 * 512
    # "dots" keeps the matmul outputs: the hidden pre-tanh, and the block's output.
    assert traced("dots") == {"wide": 3 * rows * 512, "narrow": 5 * rows * 64}
    assert traced("none") == {"wide": 0, "narrow": 0}
    # An "offload" row: its compile (on CPU) counted the host-held outputs as device memory,
    # so their share per device comes off it (and is its `host_bytes`), and they go out and
    # back over PCIe.
    pcie = eqxshard.links.Link(bandwidth=1e9, latency=1e-5)
    v = Layout("DP + remat offload", {"data": 2}, P(), remat=(("wide", "offload"),))
    compiled = candidate_row("DP + remat offload", 5 << 20, False)
    base = candidate_row("DP", 6 << 20, False)
    row = policies.described(compiled, v, base, traced, budget=4 << 20, links={"host": pcie})
    away = rows * 3 * 512 // 2
    assert row.total_bytes == (5 << 20) - away and row.bytes["activations"] == (5 << 20) - away
    assert row.host_bytes == away
    assert row.fits and "remat offload on `wide`: fits with" in row.note()
    assert "1.5 MiB of activations per device in host memory, out and back" in row.reason
    assert row.host_time == pytest.approx(2 * (1e-5 + away / 1e9))
    assert row.time == pytest.approx(1.0 + row.host_time)
    # With a tensor-parallel axis some may be whole on each device: at least that share.
    tp = Layout("TP + remat offload", {"model": 2}, P(), remat=(("wide", "offload"),))
    row = policies.described(compiled, tp, base, traced, budget=4 << 20, links={"host": pcie})
    assert "1.5 MiB of activations per device in host memory (at least)" in row.reason
    # A compile that counted them apart (GPU, TPU: `host_temp_size_in_bytes`, already in
    # the row's `host_bytes`) is taken as it is: nothing comes off its device total twice.
    apart = eqxshard.report.Candidate(**{**compiled.__dict__, "host_bytes": 3 << 20})
    row = policies.described(
        apart, v, base, traced, budget=4 << 20, links={"host": pcie}, apart=3 << 20
    )
    assert row.total_bytes == 5 << 20 and row.host_bytes == 3 << 20 and not row.fits
    assert "3.0 MiB of activations per device in host memory, out and back" in row.reason
    assert row.host_time == pytest.approx(2 * (1e-5 + (3 << 20) / 1e9))


def test_a_mix_rematerialises_the_fewest_largest_stacks_that_cover_the_excess():
    base = Layout("DP", {"data": 2}, P())
    without, every = candidate_row("DP", 1000, False), candidate_row("DP + remat full", 400, True)
    saving = {"a": 100, "b": 500, "c": 400}  # shares of the 600 bytes the compile saved
    # 150 over: "b" alone saves ~300 by its share, more than 1.1 x 150.
    some = per_stack.mix(base, without, every, "full", saving, 850)
    assert some is not None and some.name == "DP + remat full on b"
    assert some.remat == (("a", "none"), ("b", "full"), ("c", "none"))
    # 400 over: "b" and "c" (~540 saved) are needed, not "a".
    some = per_stack.mix(base, without, every, "dots", saving, 600)
    assert some is not None and dict(some.remat) == {"a": "none", "b": "dots", "c": "dots"}
    # Every stack needed, remat on every stack not fitting, shares unknown, one stack: none.
    assert per_stack.mix(base, without, every, "full", saving, 420) is None
    assert per_stack.mix(base, without, candidate_row("x", 900, False), "full", saving, 850) is None
    assert per_stack.mix(base, without, every, "full", None, 850) is None
    assert per_stack.mix(base, without, every, "full", {"a": 1}, 850) is None


def test_a_plan_takes_a_policy_per_stack_or_one_for_all():
    model = numpy_filled(sd.make_two, jax.random.key(0))  # any weights: no eager init
    per_stack = eqxshard.Plan(
        mesh={"data": 2}, rules=P(), batch_spec=P("data"), remat={"wide": "dots", "narrow": "none"}
    )
    one = eqxshard.Plan(mesh={"data": 2}, rules=P(), batch_spec=P("data"), remat="full")
    for plan in (per_stack, one):
        assert eval(repr(plan), {"Plan": eqxshard.Plan, "P": P, "PartitionSpec": P}) == plan
    assert "remat='full'" in repr(one) and per_stack != one
    configured = per_stack.apply(model)
    assert (configured.wide.remat, configured.narrow.remat) == ("dots", "none")
    configured = one.apply(model)
    assert (configured.wide.remat, configured.narrow.remat) == ("full", "full")
    x = sd.data(4, 4)[0]
    np.testing.assert_allclose(jax.vmap(configured)(x), jax.vmap(model)(x), rtol=1e-5)
    with pytest.raises(ValueError, match=r"`remat='some'`; a policy for every stacked layer"):
        eqxshard.Plan(mesh={"data": 2}, rules=P(), batch_spec=P(), remat="some")
    with pytest.raises(TypeError, match=r"or one policy for every stacked layer"):
        eqxshard.Plan(mesh={"data": 2}, rules=P(), batch_spec=P(), remat=["dots"])  # pyright: ignore[reportArgumentType]


def test_nothing_fits_says_remat_was_tried_and_by_how_much_it_is_over():
    plain = candidate_row("DP", 3 << 20, False)
    remat = eqxshard.report.Candidate(
        **{**candidate_row("DP + remat full", 2 << 20, False).__dict__, "remat": {"blocks": "full"}}
    )
    error = nothing_fits(ranked([plain, remat], 1 << 20), 1 << 20, 2, 16)
    message = str(error)
    assert "Rematerialising the stacked layers was tried (full)" in message
    assert "(DP + remat full on data=2) is still 1.0 MiB over" in message
    assert "activation checkpointing" not in message
    error = nothing_fits(ranked([plain], 1 << 20), 1 << 20, 2, 16)
    assert "activation checkpointing in `step`" in str(error)
    assert "was tried" not in str(error)


def test_a_chosen_remat_row_says_what_it_spares_once():
    # Each row says what it chose and how it stands against the budget apart from the rest.
    chosen = candidate_row(
        "DP + remat full",
        512 << 10,
        True,
        reason="without it 1.0 MiB over",
        choice_note="remat full on `blocks`",
        budget_note="fits with 512.0 KiB to spare",
    )
    over = candidate_row(
        "FSDP + remat dots",
        2 << 20,
        False,
        reason="without it 2.0 MiB over",
        choice_note="remat dots on `blocks`",
        budget_note="still 1.0 MiB over",
    )
    assert chosen.note() == (
        "remat full on `blocks`: fits with 512.0 KiB to spare; without it 1.0 MiB over"
    )
    table = ranked([chosen, over], 1 << 20)
    assert table[0].reason == (
        "chosen: fits with 512.0 KiB to spare; the only one that fits; "
        "remat full on `blocks`: without it 1.0 MiB over"
    )
    assert table[1].reason.startswith("over budget by 1.0 MiB (most is activations: 2.0 MiB); ")
    assert table[1].reason.endswith("remat dots on `blocks`: without it 2.0 MiB over")


def _search(host: eqxshard.links.Link) -> eqxshard.Plan:
    """`auto_plan` of the two stacks on 2 devices in 4 MiB, compute dominating the step (a
    slow device, so remat's recomputed flops count), host memory over `host`."""
    model = sd.make_two(jax.random.key(0))
    return eqxshard.auto_plan(
        sd.step,
        model,
        sd.shapes(BATCH, TOKENS),
        devices=2,
        budget="4MiB",
        optimizer=sd.OPTIMIZER,
        progress=False,
        flops_per_second=1e9,
        links={"host": host},
    )


@pytest.mark.heavy
def test_auto_plan_rematerialises_only_the_wide_stack():
    # Host memory is far (a slow `host` link), so offloading does not pay.
    plan = _search(eqxshard.links.Link(bandwidth=1e7, latency=1e-3))
    assert plan.remat == {"wide": "full", "narrow": "none"} and plan.pipeline is None
    chosen = plan.chosen
    assert chosen.remat == plan.remat and chosen.name.endswith("+ remat full on wide")
    assert "remat full on `wide` only (`narrow` kept whole" in chosen.reason
    assert chosen.reason.count("to spare") == 1
    # The same layout with every stack rematerialised fits too, and is slower.
    every = next(c for c in plan.table if c.name == chosen.name.removesuffix(" on wide") and c.fits)
    assert every.remat == {"wide": "full", "narrow": "full"}
    assert (every.time or 0) > (chosen.time or 0)
    namespace = {"Plan": eqxshard.Plan, "P": P, "PartitionSpec": P, "fsdp": eqxshard.fsdp}
    assert eval(repr(plan), namespace) == plan
    _runs_as_its_row(plan)


def _runs_as_its_row(plan: eqxshard.Plan) -> None:
    """`plan.jit(step)` compiles to the chosen row's bytes per device (on CPU its compile
    counts what the row holds in host memory as device memory), and trains as one device."""
    made, state = plan.init(sd.make_two, sd.OPTIMIZER)(jax.random.key(0))
    remat = plan.chosen.remat
    assert (made.wide.remat, made.narrow.remat) == (remat["wide"], remat["narrow"])
    batch = sd.data(BATCH, TOKENS)
    train_step = plan.jit(sd.step)
    total = compiled_total(train_step.lower(made, state, batch).compile().memory_analysis())
    total -= plan.chosen.host_bytes
    assert abs(total - (plan.chosen.total_bytes or 0)) <= 0.01 * total
    one = sd.make_two(jax.random.key(0))
    one_state = sd.OPTIMIZER.init(eqx.filter(one, eqx.is_array))
    one_step = eqx.filter_jit(sd.step)
    for _ in range(2):
        made, state, loss = train_step(made, state, batch)
        one, one_state, one_loss = one_step(one, one_state, batch)
        np.testing.assert_allclose(loss, one_loss, rtol=1e-5)


@pytest.mark.heavy
def test_a_fast_host_link_chooses_offload_whose_plan_holds_its_row():
    # Compute is slow and host memory near: keeping the matmul outputs in host memory
    # beats recomputing them ("full"), and fits where keeping them on the device ("dots")
    # does not.
    plan = _search(eqxshard.links.Link(bandwidth=1e12, latency=1e-7))
    assert set(plan.chosen.remat.values()) == {"offload"} and plan.offload == ()
    chosen = plan.chosen
    # The saved matmul outputs (the wide and narrow hidden pre-tanh of every layer) are in
    # host memory, the whole batch's split over the two devices: no longer on the device.
    rows = BATCH * TOKENS * F32
    assert chosen.host_bytes == rows * (3 * 512 + 5 * 64) // 2
    said = f"{format_bytes(chosen.host_bytes)} of activations per device in host memory, out"
    assert said in chosen.reason
    # On CPU the compile is "dots"'s (the same outputs saved), which does not fit.
    same = [c for c in plan.table if c.mesh_shape == chosen.mesh_shape]
    dots = next(c for c in same if c.name.endswith("remat dots"))
    assert chosen.fits and not dots.fits
    assert (chosen.total_bytes or 0) + chosen.host_bytes == pytest.approx(dots.total_bytes, 0.01)
    _runs_as_its_row(plan)
