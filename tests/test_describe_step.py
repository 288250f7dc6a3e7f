"""`describe_step`: a compiled step's layouts, the share of its work each device does, and
the ops XLA runs on one device and replicates, e.g. `eqx.error_if` in the loss
(eqxshard/_step/describe_step.py, _step/pinned.py)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxshard
from eqxshard import describe_step
from eqxshard._step.pinned import pinned_ops
from eqxshard.report import StepLeaf

OPTIMIZER = optax.sgd(0.1)


def mesh8():
    return make_mesh("auto", shape=(8,), names=("data",))


def model_and_batch():
    model = eqx.nn.MLP(32, 10, 64, 2, key=jax.random.key(0))
    return model, jnp.ones((64, 32)), jnp.zeros((64,), jnp.int32)


def make_step(check: str | None, mesh):
    """A training step; `check` puts `eqx.error_if` on the inputs or the labels."""

    def loss(model, x, y):
        if check == "x":
            x = eqx.error_if(x, jnp.isnan(x), "NaN input")
        if check == "y":
            y = eqx.error_if(y, y < 0, "negative label")
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @eqxshard.filter_jit(in_shardings=(P(), P("data"), P("data")), mesh=mesh)
    def step(model, x, y):
        value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads)), value

    return step


def test_a_split_step_is_split_and_lists_its_layouts() -> None:
    mesh = mesh8()
    report = describe_step(make_step(None, mesh), *model_and_batch())
    assert report.devices == 8 and report.pinned == []
    assert report.work_fraction == pytest.approx(1 / 8, rel=0.1)
    assert not report.runs_replicated and report.problems() == []
    paths = [leaf.path for leaf in report.inputs]
    assert paths[0] == "args.0.layers.0.weight" and paths[-2:] == ["args.1", "args.2"]
    assert report.inputs[-1].asked == NamedSharding(mesh, P("data"))
    assert report.inputs[-1].compiled is not None
    assert report.inputs[-1].compiled.is_equivalent_to(NamedSharding(mesh, P("data")), 1)
    assert [leaf.path for leaf in report.outputs][-1] == "out.1"  # the loss
    assert report.outputs[-1].asked is None and report.outputs[-1].shape == ()
    assert report.memory["argument"] > 0
    text = str(report)
    assert "args.1" in text and "P('data',)" in text and "an even split: 12.5%" in text


def test_error_if_on_the_inputs_makes_xla_run_the_loss_replicated() -> None:
    mesh = mesh8()
    model, x, _ = model_and_batch()

    @eqxshard.filter_jit(in_shardings=(P(), P("data")), mesh=mesh)
    def loss(model, x):
        x = eqx.error_if(x, jnp.isnan(x), "NaN input")
        return jnp.mean(jax.vmap(model)(x) ** 2)

    report = describe_step(loss, model, x)
    assert report.runs_replicated
    assert report.work_fraction == pytest.approx(1.0, rel=0.05)
    (pinned,) = report.pinned
    assert pinned.source == "`eqx.error_if`" and pinned.shapes == ("f32[64,32]",)
    assert "error_if" in pinned.op_name
    text = str(report)
    assert "XLA runs this step replicated: each of the 8 devices does 100% of its work" in text
    assert "Involuntary full rematerialization" in text and "EQX_ON_ERROR=nan" in text
    assert "move the check out of the step" in text
    # Without the check, the same loss is split.
    plain = eqxshard.filter_jit(
        lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), in_shardings=(P(), P("data")), mesh=mesh
    )
    assert describe_step(plain, model, x).work_fraction == pytest.approx(1 / 8, rel=0.1)


def test_error_if_in_a_training_step_is_named() -> None:
    # Here XLA splits the rest of the step again after replicating `x`: the work stays
    # split, but the whole batch goes through one device each step.
    report = describe_step(make_step("x", mesh8()), *model_and_batch())
    assert [(p.source, p.shapes) for p in report.pinned] == [("`eqx.error_if`", ("f32[64,32]",))]
    assert any("Involuntary full rematerialization" in line for line in report.problems())


def test_error_if_on_the_labels_is_named_too() -> None:
    report = describe_step(make_step("y", mesh8()), *model_and_batch())
    assert [(p.source, p.shapes) for p in report.pinned] == [("`eqx.error_if`", ("s32[64]",))]


def test_a_step_with_nothing_split_runs_replicated_without_pinned_ops() -> None:
    mesh = mesh8()
    model, x, y = model_and_batch()
    step = eqxshard.filter_jit(lambda m, x: jax.vmap(m)(x), in_shardings=P(), mesh=mesh)
    report = describe_step(step, model, x)
    assert report.runs_replicated and report.pinned == []
    assert any("Split the batch over the mesh" in line for line in report.problems())


def test_a_plain_function_is_wrapped_and_one_device_is_not_replicated() -> None:
    model, x, _ = model_and_batch()
    report = describe_step(lambda m, x: jax.vmap(m)(x), model, x)
    assert report.devices == 1 and not report.runs_replicated
    assert all(leaf.asked is None for leaf in report.inputs + report.outputs)
    assert str(report).count("\n") >= len(report.inputs) + len(report.outputs)


def test_describe_step_checks_its_step() -> None:
    with pytest.raises(TypeError, match=r"`describe_step` takes a function .* but got int"):
        describe_step(3)  # pyright: ignore[reportArgumentType]


def test_a_leaf_compiled_in_another_layout_is_flagged() -> None:
    mesh = mesh8()
    rows = StepLeaf(
        "out", (8,), "float32", NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    )
    assert rows.differs
    same = StepLeaf("out", (8,), "float32", NamedSharding(mesh, P()), NamedSharding(mesh, P()))
    assert not same.differs and not StepLeaf("x", (8,), "float32", None, None).differs


def test_pinned_ops_reads_callbacks_of_a_step_over_several_devices_only() -> None:
    line = (
        '  %pure_callback.1 = (s32[64]{0}) custom-call(%a, %b), custom_call_target="'
        'xla_ffi_python_gpu_callback", api_version=API_VERSION_TYPED_FFI, '
        'metadata={op_name="jit(step)/jit(branched_error_if_impl)/cond/pure_callback"}'
    )
    scalar = line.replace("(s32[64]{0})", "(s32[]{0})").replace("error_if", "other")
    head = "HloModule jit_step, num_partitions={n}\n"
    found = pinned_ops(head.format(n=8) + line + "\n" + scalar)
    assert [(p.source, p.shapes) for p in found] == [("`eqx.error_if`", ("s32[64]",))]
    assert pinned_ops(head.format(n=1) + line) == []


def test_auto_plan_says_when_a_candidate_step_has_pinned_ops() -> None:
    batch = (jax.ShapeDtypeStruct((16, 32), jnp.float32),) * 2

    def step(model, opt_state, batch):
        x, y = batch
        y = eqx.error_if(y, jnp.isnan(y), "NaN target")
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(
            model
        )
        updates, opt_state = OPTIMIZER.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss

    model = eqx.nn.MLP(32, 32, 64, 1, key=jax.random.key(0))
    plan = eqxshard.auto_plan(
        step, model, batch, devices=2, budget="64MiB", optimizer=OPTIMIZER, progress=False
    )
    measured = [c for c in plan.table if c.time is not None]
    assert measured
    for c in measured:
        assert "XLA runs `eqx.error_if` on f32[16,32] on one device" in c.reason, c.reason
        assert "EQX_ON_ERROR=nan" in c.reason
