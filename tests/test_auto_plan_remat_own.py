"""`auto_plan`'s remat search against the model's own setting (`Stacked(..., remat="full")`):
a policy that keeps no fewer bytes on the device is not compiled (its row says why), the
recomputed flops are counted against no remat from the step's jaxpr, a stack whose scan
the step does not show is named where no mix is tried, and rows not compiled show no
estimate mark."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import stacked_decoder as sd
from helpers import candidate_row, compiled_total
from jax.sharding import PartitionSpec as P

import eqxshard
from eqxshard._plans.auto import view
from eqxshard._plans.auto.candidate import not_compiled
from eqxshard._plans.auto.dimensions.remat import per_stack, policies, residuals
from eqxshard._plans.auto.layout import Layout
from eqxshard._plans.auto.measure import batch_proxies, compiled, jobs
from eqxshard._plans.auto.rank.table import nothing_fits, ranked
from eqxshard._plans.auto.trace.problem import Problem
from eqxshard._tree import is_array_like

BATCH, TOKENS, WIDTH, HIDDEN, LAYERS = 16, 32, 32, 512, 3


def _own(model: Any, **remat: str) -> Any:
    """`model` with each stack named in `remat` rebuilt with that policy as its own."""
    for path, policy in remat.items():
        stack = getattr(model, path)
        model = eqx.tree_at(
            lambda m, p=path: getattr(m, p), model, eqxshard.Stacked(stack.blocks, remat=policy)
        )
    return model


def _one(remat: str = "none", key: Any = None) -> Any:
    key = jax.random.key(0) if key is None else key
    model = sd.make(key, width=WIDTH, hidden=HIDDEN, layers=LAYERS)
    return _own(model, blocks=remat)


def _args(model: Any) -> tuple:
    """The abstract arguments of `sd.step` for `model` (abstract itself, or concrete)."""
    abstract = eqx.filter_eval_shape(lambda: model)
    state = jax.eval_shape(sd.OPTIMIZER.init, eqx.filter(abstract, is_array_like))
    return abstract, state, sd.shapes(BATCH, TOKENS)


def test_a_policy_saving_nothing_against_the_models_own_remat_is_not_compiled():
    traced = residuals.RematTrace(sd.step, _args(eqx.filter_eval_shape(_one, "full")))
    base = Layout("DP", {"data": 2}, P())
    over = candidate_row("DP", 10 << 20, False)
    for wanted in (policies.FIRST, policies.THEN):
        todo, pruned = policies.worth([(base, over)], ["blocks"], wanted, None)
        assert pruned == [] and len(todo) == len(wanted)
        keep, same = policies.saving(todo, traced)
        # "dots" keeps more than the stack's own "full"; "full" is it; "offload" keeps on
        # the device what "full" does: none is compiled, each row says why.
        assert keep == [] and [v.remat for v, _, _, _ in same] == [(("blocks", p),) for p in wanted]
        for v, b, c, row in same:
            assert b is base and c is over and row.total_bytes is None and row.time is None
            assert row.reason.startswith(f"not compiled: dominated, remat {v.remat[0][1]} keeps")
            assert "where `blocks`'s own remat='full' keeps 192.0 KiB" in row.reason
            assert "it saves nothing; the rows without remat are that setting" in row.reason
    # Counted against no remat, not against the stack's own "full" (which was 0%): "full"
    # recomputes the blocks' first matmuls (the second's output is not needed backward).
    recompute = 2.0 * BATCH * TOKENS * WIDTH * HIDDEN * LAYERS
    assert traced.recomputed(()) == pytest.approx(1 + recompute / traced.at("none").flops)
    assert traced.recomputed(()) == traced.recomputed((("blocks", "full"),))
    assert traced.recomputed((("blocks", "dots"),)) == 1.0
    full = Layout("DP + remat full", {"data": 2}, P(), remat=(("blocks", "full"),))
    row = policies.described(
        candidate_row("x", 1 << 20, True), full, over, traced, budget=2 << 20, links={}
    )
    assert "recomputes 17% more matmul flops than no remat" in row.reason


def test_a_policy_is_given_only_to_the_stacks_it_saves_on():
    model = _own(eqx.filter_eval_shape(sd.make_two, jax.random.key(0)), wide="full")
    traced = residuals.RematTrace(sd.step, _args(model))
    assert traced.own == {"wide": "full", "narrow": "none"}
    assert traced.saving_on("dots") == ["narrow"] and traced.saves_nothing("dots") == ""
    base = Layout("DP", {"data": 2}, P())
    todo, _ = policies.worth(
        [(base, candidate_row("DP", 10 << 20, False))], ["wide", "narrow"], ("dots",), None
    )
    keep, same = policies.saving(todo, traced)
    assert same == [] and [(v.name, v.remat) for v, _, _ in keep] == [
        ("DP + remat dots on narrow", (("narrow", "dots"),))
    ]
    # A mix leaves a stack with its own policy out (it keeps it), and lists one kept whole.
    without, every = candidate_row("DP", 1000, False), candidate_row("DP + remat full", 400, True)
    saving = {"a": 100, "b": 500, "c": 400}
    own = {"a": "full", "b": "none", "c": "none"}
    some = per_stack.mix(base, without, every, "dots", saving, 850, own)
    assert some is not None and some.remat == (("b", "dots"), ("c", "none"))
    # Only one stack saves anything: the variant on it is all there is to compile.
    assert per_stack.mix(base, without, every, "dots", {"a": 0, "b": 500}, 850) is None


def _wide_only(model, opt_state, batch):
    """A step that never calls `narrow`: its scan is not in the jaxpr."""

    def loss(model):
        x, y = batch
        body = lambda v: jax.vmap(model.head)(model.wide(jax.vmap(model.embed)(v)))
        out = jax.vmap(body)(x)
        return jnp.mean((out - y) ** 2)

    value, grads = eqx.filter_value_and_grad(loss)(model)
    updates, opt_state = sd.OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value


def test_a_mix_not_tried_for_a_stack_the_step_does_not_show_says_so():
    model = eqx.filter_eval_shape(sd.make_two, jax.random.key(0))
    traced = residuals.RematTrace(_wide_only, _args(model))
    assert traced.missing() == ("narrow",) and traced("full") is None
    base = Layout("DP", {"data": 2}, P())
    v = Layout("DP + remat full", {"data": 2}, P(), remat=(("wide", "full"), ("narrow", "full")))
    every = candidate_row("DP + remat full", 400, True, reason="remat full on `wide`, `narrow`")
    mixes, made = per_stack.mixes(
        [(v, base, candidate_row("DP", 1000, False))], [(v, every)], traced, 850
    )
    assert mixes == [] and made[0][0] is v
    assert made[0][1].reason == (
        "remat full on `wide`, `narrow`; remat per stack not tried: the scan of `narrow` "
        "was not found in the step"
    )


def test_rows_not_compiled_show_no_estimate_mark_and_a_slower_offload_says_why():
    estimated = candidate_row("TP", 10 << 20, False, estimated=True, time=5.0)
    v = Layout("TP + remat dots", {"model": 2}, P(), remat=(("blocks", "dots"),))
    row = policies.dominated(v, estimated, 1.0)
    assert not row.estimated and row.total_bytes is None
    table = ranked([candidate_row("DP", 1 << 20, True), estimated, row], 2 << 20)
    plan = eqxshard.Plan(mesh={"data": 2}, rules=P(), batch_spec=P("data"), table=table)
    _, body = view.rows(plan.table)
    assert body[2][1] == "TP + remat dots" and "~-" not in body[2]
    assert body[1][-4].startswith("~")  # the estimated total keeps its mark
    fast, slow = (
        candidate_row("DP", 1 << 20, True),
        candidate_row("DP + offload", 1 << 20, True, host_time=0.5),
    )
    slow = eqxshard.report.Candidate(**{**slow.__dict__, "time": 1.5})
    assert ranked([fast, slow], 2 << 20)[1].reason == (
        "fits, but 1.50x the chosen step time: host memory traffic 500.00 ms vs 0 s"
    )


def test_a_models_own_remat_compiles_its_rows_as_remat_variants_are():
    model = eqx.filter_eval_shape(_one, "full")
    problem = Problem(sd.step, model, None, sd.shapes(BATCH, TOKENS))
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    assert compiled.step_arguments(problem, mesh, P(), problem.batch, P("data")).remat
    plain = Problem(sd.step, eqx.filter_eval_shape(_one), None, problem.batch)
    assert not compiled.step_arguments(plain, mesh, P(), plain.batch, P("data")).remat


@pytest.mark.heavy
def test_auto_plan_compiles_no_remat_that_saves_nothing_and_its_plan_runs(monkeypatch):
    compiled: list[Any] = []
    original = jobs.compile_here

    def counting(problem, placed, shape):
        compiled.append(placed)
        return original(problem, placed, shape)

    monkeypatch.setattr(jobs, "compile_here", counting)
    fresh: dict = {}  # nothing cached by other tests: every compile is counted
    monkeypatch.setattr(jobs, "CACHE", fresh)
    monkeypatch.setattr(batch_proxies, "CACHE", fresh)
    monkeypatch.setattr(jobs, "share_alongside", lambda rest, seconds: [])
    far = eqxshard.links.Link(bandwidth=1e7, latency=1e-3)  # offloading the state does not pay
    options: dict[str, Any] = dict(
        devices=2, budget="3.5MiB", optimizer=sd.OPTIMIZER, progress=False, links={"host": far}
    )
    model = eqx.filter_eval_shape(_one, "full")
    plan = eqxshard.auto_plan(sd.step, model, sd.shapes(BATCH, TOKENS), **options)
    made = [c for c in plan.table if c.measured_on == "compiled here"]
    assert len(compiled) == len(made) and all(p.remat for p in compiled)
    remats = [c for c in plan.table if c.remat]
    assert remats and all(c.measured_on == "not compiled" for c in remats)
    assert any("saves nothing" in c.reason for c in remats)
    assert plan.remat == {} and plan.chosen.fits
    # The table's bytes are what `plan.jit(step)` compiles to, with the stack's own remat.
    model, state = plan.init(lambda key: _one("full", key), sd.OPTIMIZER)(jax.random.key(0))
    assert model.blocks.remat == "full"
    batch = sd.data(BATCH, TOKENS)
    train_step = plan.jit(sd.step)
    total = compiled_total(train_step.lower(model, state, batch).compile().memory_analysis())
    assert abs(total - (plan.chosen.total_bytes or 0)) <= 0.01 * total
    one = _one("full")
    _, _, one_loss = eqx.filter_jit(sd.step)(
        one, sd.OPTIMIZER.init(eqx.filter(one, eqx.is_array)), batch
    )
    _, _, loss = train_step(model, state, batch)
    np.testing.assert_allclose(loss, one_loss, rtol=1e-5)


def test_nothing_fits_says_the_stacks_own_remat_is_the_least_already():
    over = candidate_row("DP", 3 << 20, False)
    v = Layout("DP + remat dots", {"data": 2}, P(), remat=(("blocks", "dots"),))
    why = "not compiled: dominated, remat dots keeps 1 B ...: it saves nothing; the rows ..."
    same = not_compiled(v, why, remat={"blocks": "dots"})
    message = str(nothing_fits(ranked([over, same], 1 << 20), 1 << 20, 2, 16))
    assert "The stacked layers' own `remat` keeps the least on the device already" in message
    assert "activation checkpointing" not in message and "a smaller batch" in message
