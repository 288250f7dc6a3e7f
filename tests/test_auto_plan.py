# ruff: noqa: E501  (the HLO text below is XLA's, one long instruction per line)
"""`auto_plan`: the chosen layout fits by a compile made here, ranks right against a
hand-built candidate, trains like the unsharded model, and explains itself."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import kept_layout_total, mse_step
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import eqxshard
from eqxshard._plans.auto.dimensions.tensor_parallel import tensor_parallel_roles
from eqxshard._plans.auto.measure import jobs
from eqxshard._plans.auto.measure.collectives import collectives
from eqxshard._plans.auto.scale.extrapolate import reduced_shape

OPTIMIZER = optax.adamw(1e-2)
# Parameters, gradients and AdamW's state replicated take 1.03 MiB: data parallel does
# not fit this budget on any number of devices; the sharded layouts do.
BUDGET = "1MiB"
BATCH = (jax.ShapeDtypeStruct((16, 128), jnp.float32),) * 2


def make_model(key):
    return eqx.nn.MLP(128, 128, 256, 1, key=key)  # up (256, 128), down (128, 256)


step = mse_step(OPTIMIZER)


def auto_plan(**kwargs):
    options: dict[str, Any] = dict(devices=4, budget=BUDGET, optimizer=OPTIMIZER, progress=False)
    return eqxshard.auto_plan(step, make_model(jax.random.key(0)), BATCH, **(options | kwargs))


@pytest.fixture(scope="module")
def plan():
    return auto_plan()


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 128)).astype(np.float32)
    return x, np.tanh(x[:, ::-1]).copy()


def test_chosen_plan_fits_by_its_own_compile_and_trains_like_unsharded(plan):
    chosen = plan.chosen
    assert chosen.fits and chosen.rank == 1 and chosen.reason.startswith("chosen")
    assert plan.mesh.size == 4 and dict(plan.mesh.shape) == chosen.mesh_shape
    model = make_model(jax.random.key(0))
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    batch = _data()
    sharded = plan.shard(model, opt_state, batch)
    loss_sharding = NamedSharding(plan.mesh, P())
    model, opt_state, batch = sharded
    total = kept_layout_total(step, model, opt_state, batch, loss_sharding)
    assert total <= plan.budget
    assert abs(total - chosen.total_bytes) <= 0.05 * total
    # Three steps under the plan and unsharded give the same losses and parameters.
    jitted = eqx.filter_jit(step)
    model_a, state_a, batch_a = sharded
    model_b, state_b = model, opt_state
    for _ in range(3):
        model_a, state_a, loss_a = jitted(model_a, state_a, batch_a)
        model_b, state_b, loss_b = jitted(model_b, state_b, batch)
        np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
    leaves_a = jax.tree.leaves(eqx.filter(model_a, eqx.is_array))
    leaves_b = jax.tree.leaves(eqx.filter(model_b, eqx.is_array))
    for a, b in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5)  # Adam: lr 1e-2 steps


def test_ranking_against_a_hand_built_candidate(plan):
    # FSDP over 4 devices, built by hand: every leaf split along its largest dim.
    model = make_model(jax.random.key(0))
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    rule = eqxshard.fsdp("fsdp")
    model_s = eqxshard.filter_shard(model, mesh, rule)
    state_s = eqxshard.filter_shard(opt_state, mesh, rule)
    batch_s = eqxshard.filter_shard(_data(), mesh, P("fsdp"))
    total = kept_layout_total(step, model_s, state_s, batch_s, NamedSharding(mesh, P()))
    (row,) = [c for c in plan.table if c.mesh_shape == {"fsdp": 4}]
    assert abs(row.total_bytes - total) <= 0.05 * total
    assert row.fits == (total <= plan.budget)
    assert row.bytes["parameters"] == eqxshard.describe(model, mesh, rule).max_bytes_per_device
    # The chosen plan is at least as fast; fitting rows come first, fastest first.
    assert plan.chosen.time <= row.time and plan.chosen.rank < row.rank
    fitting = [c for c in plan.table if c.fits]
    assert plan.table[: len(fitting)] == fitting
    assert [c.time for c in fitting] == sorted(c.time for c in fitting)
    # Data parallel does not fit (parameters, gradients and Adam replicated: 1.03 MiB).
    (dp,) = [c for c in plan.table if c.name == "DP"]
    assert not dp.fits and "over budget by" in dp.reason
    assert [c.rank for c in plan.table] == list(range(1, len(plan.table) + 1))


def test_table_has_parts_collectives_and_reasons(plan):
    for c in plan.table:
        if c.time is None:
            continue
        parts = ("parameters", "gradients", "optimizer state", "batch", "activations")
        assert set(c.bytes) == set(parts) and c.total_bytes == pytest.approx(
            sum(c.bytes.values()), rel=0.01
        )
        assert c.time == pytest.approx(c.communication_time + c.compute_time + c.host_time)
        assert not c.estimated and c.measured_on == "compiled here"
    tp = [c for c in plan.table if c.name == "TP"]
    assert tp and tp[0].collectives.get("all-reduce", 0) > 0  # the out-projection's sums
    assert any("fits, but" in c.reason for c in plan.table)
    text = str(plan)
    assert "Chosen:" in text and "sent per device" in text and "over budget by" in text
    html = plan._repr_html_()
    assert html.count("<svg") == 1 and "budget" in html and "<table>" in html
    assert f"Plan(mesh={plan.chosen.mesh_shape!r}" in repr(plan)


def test_rules_repr_is_python_that_lays_out_the_same():
    model = make_model(jax.random.key(0))
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    names = {"path_rules": eqxshard.path_rules, "fsdp": eqxshard.fsdp, "P": P}
    plan = auto_plan(budget="64MiB")
    for c in plan.table:
        mesh = AbstractMesh(
            tuple(c.mesh_shape.values()), tuple(c.mesh_shape), (AxisType.Auto,) * len(c.mesh_shape)
        )
        pasted = eval(repr(c.rules), names)
        for tree in (model, opt_state):
            assert eqxshard.filter_shardings(tree, mesh, pasted) == eqxshard.filter_shardings(
                tree, mesh, c.rules
            )
    (tp,) = [c for c in plan.table if c.name == "TP"]
    specs = eqxshard.filter_shardings(model, AbstractMesh((4,), ("model",)), tp.rules)
    assert specs.layers[0].weight.spec == P("model", None)  # in-projection: output dim
    assert specs.layers[0].bias.spec == P("model")
    assert specs.layers[1].weight.spec == P(None, "model")  # out-projection: input dim
    assert specs.layers[1].bias.spec == P()


def test_init_is_born_in_the_layout_shard_gives(plan):
    model, opt_state = plan.init(make_model, OPTIMIZER)(jax.random.key(0))
    ref = plan.shard(make_model(jax.random.key(0)), OPTIMIZER.init(eqx.filter(model, eqx.is_array)))
    arrays = lambda tree: jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    for a, b in zip(arrays((model, opt_state)), arrays(ref[:2]), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(a, b)
    assert ref[2] is None


def test_second_call_compiles_nothing(plan, monkeypatch):
    calls = []
    original = jobs.compile_here
    monkeypatch.setattr(jobs, "compile_here", lambda *a: calls.append(a) or original(*a))
    again = auto_plan()
    assert not calls
    assert [(c.name, c.mesh_shape, c.total_bytes) for c in again.table] == [
        (c.name, c.mesh_shape, c.total_bytes) for c in plan.table
    ]


def test_a_step_without_optimizer():
    evaluate = lambda model, batch: jnp.mean((jax.vmap(model)(batch[0]) - batch[1]) ** 2)
    model = make_model(jax.random.key(0))
    plan = eqxshard.auto_plan(evaluate, model, BATCH, devices=4, budget="1MiB", progress=False)
    assert plan.chosen.fits
    assert set(plan.chosen.bytes) == {"parameters", "batch", "activations"}
    sharded, state, batch = plan.shard(model, None, _data())
    assert state is None
    np.testing.assert_allclose(evaluate(sharded, batch), evaluate(model, _data()), rtol=1e-5)


def test_devices_as_a_list_or_a_shape(plan):
    on_last_four = auto_plan(devices=jax.devices()[4:])
    assert isinstance(on_last_four.mesh, jax.sharding.Mesh)  # devices this machine has
    assert set(on_last_four.mesh.devices.flat) == set(jax.devices()[4:])
    assert on_last_four.chosen.mesh_shape == plan.chosen.mesh_shape
    for shape in ((2, 2), AbstractMesh((2, 2), ("a", "b"))):
        assert auto_plan(devices=shape).mesh.size == 4


def test_links_change_the_estimate(plan):
    slow_link = eqxshard.links.Link(1e9, 1e-4)
    slow = auto_plan(links={"data": "ethernet_100g", "fsdp": slow_link, "model": slow_link})
    compared = 0
    for a in slow.table:
        (b,) = [c for c in plan.table if c.name == a.name and c.mesh_shape == a.mesh_shape]
        # (A layout with the state offloaded is compiled only where it could beat the
        # fastest that fits, which the links change: compare those measured in both.)
        if a.time is not None and b.time is not None and a.collectives:
            assert a.communication_time > b.communication_time
            compared += 1
    assert compared >= 4
    assert eqxshard.links.LINKS["intra_node"] == eqxshard.links.LINKS["nvlink4"]


def test_user_rules_are_candidates_on_every_mesh():
    mine = eqxshard.path_rules([(r"layers\.0\.weight", P("fsdp", None)), (".*", P())])
    plan = auto_plan(rules=[mine], budget="64MiB")
    rows = [c for c in plan.table if c.name == "rules[0]"]
    assert len(rows) == 6  # every factorisation of 4
    assert {c.rules is mine for c in rows} == {True}
    missing = [c for c in rows if "fsdp" not in c.mesh_shape]
    assert missing and all(c.time is None and "fsdp" in c.reason for c in missing)


def test_tensor_parallel_found_from_structure_and_shapes():
    class Block(eqx.Module):
        attention: eqx.nn.MultiheadAttention
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.attention = eqx.nn.MultiheadAttention(4, 16, key=k1)
            self.up = eqx.nn.Linear(16, 64, key=k2)
            self.down = eqx.nn.Linear(64, 16, key=k3)

    class Model(eqx.Module):
        embed: eqx.nn.Embedding
        position: jax.Array
        blocks: list
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, 4)
            self.embed = eqx.nn.Embedding(32, 16, key=keys[0])
            self.position = jnp.zeros((8, 16))
            self.blocks = [Block(keys[1]), Block(keys[2])]
            self.head = eqx.nn.Linear(16, 32, use_bias=False, key=keys[3])

    roles = tensor_parallel_roles(eqx.filter_eval_shape(Model, jax.random.key(0)))
    kinds = {path: role.kind for path, role in roles.items()}
    for k in (0, 1):
        b = f"blocks.{k}"
        for name in ("query_proj", "key_proj", "value_proj"):
            assert kinds[f"{b}.attention.{name}.weight"] == "in"
        assert kinds[f"{b}.attention.output_proj.weight"] == "out"
        assert kinds[f"{b}.up.weight"] == "in" and kinds[f"{b}.up.bias"] == "bias"
        assert kinds[f"{b}.down.weight"] == "out" and f"{b}.down.bias" not in kinds
    assert kinds["embed.weight"] == "in" and kinds["head.weight"] == "in"
    assert "position" not in kinds  # not a matmul weight


# HLO text as XLA prints it: one instruction per (long) line.
HLO = """\
HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0} all-reduce(f32[8]{0} %x), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add
}

ENTRY %main (a: f32[4,8]) -> f32[16,8] {
  %ag = f32[16,8]{1,0} all-gather(f32[4,8]{1,0} %a), channel_id=2, replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}
  %rs = f32[2,8]{1,0} reduce-scatter(f32[4,8]{1,0} %a), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  %t = (f32[3]{0}, bf16[2,2]{1,0}) all-reduce(f32[3]{0} %c, bf16[2,2]{1,0} %d), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}
  %cp = f32[5]{0} collective-permute(f32[5]{0} %e), channel_id=4, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %same = f32[5]{0} collective-permute(f32[5]{0} %e), channel_id=5, source_target_pairs={{0,0},{1,1}}
  %w = (s32[], f32[8]) while((s32[], f32[8]) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_collectives_read_from_hlo_text():
    found = collectives(HLO, {"data": 2, "model": 4})
    summary = [(c.kind, c.bytes, c.axes, c.group_size, c.count) for c in found]
    assert summary == [
        ("all-reduce", 32, ("model",), 4, 3),  # in the loop body, 3 trips
        ("all-gather", 512, ("data", "model"), 4, 1),
        ("reduce-scatter", 64, ("data",), 2, 1),
        ("all-reduce", 20, ("data",), 2, 1),
        ("collective-permute", 20, ("model",), 2, 1),
    ]


def test_reduced_shape_shrinks_data_first_then_keeps_axes():
    assert reduced_shape({"data": 8, "fsdp": 8, "model": 8}, 64) == {
        "data": 1,
        "fsdp": 8,
        "model": 8,
    }
    assert reduced_shape({"data": 4, "fsdp": 64, "model": 2}, 8) == {
        "data": 1,
        "fsdp": 4,
        "model": 2,
    }
    assert reduced_shape({"fsdp": 512}, 8) == {"fsdp": 8}
    assert math.prod(reduced_shape({"data": 3, "model": 9}, 4).values()) <= 4


# Errors: each raised before any compile, naming the argument.


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(devices=0), ValueError, r"`devices` >= 1"),
        (dict(devices="eight"), TypeError, r"takes `devices` as a count"),
        (dict(devices=[jax.devices()[0]] * 2), ValueError, r"same device more than once"),
        (dict(budget="lots"), ValueError, r"could not read `budget='lots'`"),
        (dict(budget=-1), ValueError, r"`budget` as a finite number > 0"),
        (dict(budget=float("inf")), ValueError, r"`budget` as a finite number > 0.*got inf"),
        (dict(flops_per_second=0), ValueError, r"`flops_per_second` as a finite number > 0"),
        (dict(flops_per_second=float("nan")), ValueError, r"`flops_per_second`.*got nan"),
        (dict(flops_per_second="fast"), TypeError, r"`flops_per_second` as a number"),
        (dict(budget=[1]), TypeError, r"takes `budget` as bytes"),
        (dict(budget=None), ValueError, r"needs a `budget`.*memory_stats"),
        (dict(optimizer="adam"), TypeError, r"`optimizer` as an optax transformation"),
        (dict(rules=P()), TypeError, r"`rules` as a list"),
        (dict(compile_limit=0), ValueError, r"`compile_limit` as an int >= 1"),
        (dict(links="carrier pigeon"), ValueError, r"not a preset"),
        (dict(links=3), TypeError, r"preset name .* or an `eqxshard.links.Link`"),
        (dict(links={"pipeline": "pcie4"}), ValueError, r"names axes \['pipeline'\]"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        auto_plan(**kwargs)


def test_bad_step_and_batch():
    model = make_model(jax.random.key(0))
    with pytest.raises(TypeError, match=r"callable `step`"):
        eqxshard.auto_plan(None, model, BATCH, devices=4, budget=BUDGET, optimizer=OPTIMIZER)  # pyright: ignore[reportArgumentType]

    def broken(model, opt_state, batch):
        return model(batch[0]), opt_state, 0.0  # an MLP takes one vector, not a batch

    with pytest.raises(ValueError, match=r"could not trace `step`.*raised"):
        eqxshard.auto_plan(broken, model, BATCH, devices=4, budget=BUDGET, optimizer=OPTIMIZER)
    with pytest.raises(ValueError, match=r"must return `\(model, opt_state, loss\)`"):
        eqxshard.auto_plan(
            lambda m, o, b: m, model, BATCH, devices=4, budget=BUDGET, optimizer=OPTIMIZER
        )
    ragged = (BATCH[0], jax.ShapeDtypeStruct((8, 128), jnp.float32))
    with pytest.raises(
        ValueError, match=r"(?s)share a leading \(batch\) dim.*\n  1  shape \(8, 128\)"
    ):
        eqxshard.auto_plan(step, model, ragged, devices=4, budget=BUDGET, optimizer=OPTIMIZER)
    with pytest.raises(ValueError, match=r"at least one array leaf"):
        eqxshard.auto_plan(step, model, (1, 2), devices=4, budget=BUDGET, optimizer=OPTIMIZER)
    with pytest.raises(TypeError, match=r"`Link` takes `bandwidth` as a number"):
        eqxshard.links.Link("fast", 0.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"`bandwidth` > 0"):
        eqxshard.links.Link(0.0, 0.0)


def test_nothing_fits_names_the_smallest_footprint_and_what_would_help(plan):
    with pytest.raises(ValueError, match=r"no layout of 4 devices fits `budget` = 64.0 KiB") as e:
        auto_plan(budget="64KiB")
    message = str(e.value)
    assert "The smallest footprint is" in message and "most of it" in message
    assert "more devices (now 4)" in message
    # No weight of this MLP splits over 2 or 4 (so no TP), and a batch of 3 splits over
    # no data axis: every layout is rejected before compiling.
    odd_model = eqx.nn.MLP(5, 5, 7, 1, key=jax.random.key(0))
    odd_batch = (jax.ShapeDtypeStruct((3, 5), jnp.float32),) * 2
    with pytest.raises(ValueError, match=r"(?s)could not build any layout.*batch of 3 does not"):
        eqxshard.auto_plan(
            step, odd_model, odd_batch, devices=4, budget=BUDGET, optimizer=OPTIMIZER
        )


def test_a_plan_for_more_devices_than_here_cannot_place():
    plan = eqxshard.Plan(
        mesh=AbstractMesh((64,), ("fsdp",)), rules=P(), batch_spec=P("fsdp"), table=[], budget=1
    )
    # The mesh it says to build has Auto axes, as the plan's own meshes have.
    needs = r"`Plan.shard` needs the devices.*make_mesh\(\(64,\), .*AxisType.Auto,\) \* 1\)"
    with pytest.raises(ValueError, match=needs):
        plan.shard(make_model(jax.random.key(0)))
    with pytest.raises(ValueError, match=r"`Plan.init` needs the devices"):
        plan.init(make_model)


@pytest.mark.heavy
def test_estimate_within_ten_percent_of_a_subprocess_compile():
    """16 devices: compiled in a subprocess with 16 CPU devices, and estimated from 8."""
    compiled = auto_plan(devices=16, compile_limit=16)
    estimated = auto_plan(devices=16, compile_limit=8)
    (a,) = [c for c in compiled.table if c.mesh_shape == {"data": 2, "fsdp": 8}]
    (b,) = [c for c in estimated.table if c.mesh_shape == {"data": 2, "fsdp": 8}]
    assert a.measured_on == "compiled on 16 CPU devices in a subprocess" and not a.estimated
    assert b.estimated and b.measured_on.startswith("estimated from a compile on data=1 x fsdp=8")
    assert a.total_bytes is not None and b.total_bytes is not None
    assert abs(b.total_bytes - a.total_bytes) <= 0.1 * a.total_bytes
    sent_a, sent_b = sum(a.collectives.values()), sum(b.collectives.values())
    assert abs(sent_b - sent_a) <= 0.1 * sent_a
    assert str(estimated).count("~") > 0 and "estimated from a compile" in str(estimated)
    assert isinstance(compiled.mesh, AbstractMesh) and compiled.mesh.size == 16


@pytest.mark.heavy
def test_a_failed_subprocess_compile_says_what_to_do():
    from eqxshard._plans.auto.measure import compile_remote

    with pytest.raises(
        RuntimeError, match=r"(?s)could not compile on 4 CPU devices.*`compile_limit`"
    ):
        compile_remote.finish(
            compile_remote._launch(["this is not StableHLO"], [{"data": 4}], [False])
        )
