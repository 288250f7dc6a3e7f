"""Using an `auto_plan` result in one line: `plan.jit(step)` compiles the step with the
plan's layouts (bytes per device as the table says, losses as one device's),
`plan.apply(model)` lays the model out, and `repr(plan)` is Python for an equal plan."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import compiled_total, mse_step
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import eqxshard

OPTIMIZER = optax.adamw(1e-2)
BATCH = (jax.ShapeDtypeStruct((16, 128), jnp.float32),) * 2


def make_model(key):
    return eqx.nn.MLP(128, 128, 256, 1, key=key)


step = mse_step(OPTIMIZER)


def evaluate(model, batch):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 128)).astype(np.float32)
    return x, np.tanh(x[:, ::-1]).copy()


@pytest.fixture(scope="module")
def plan():
    model = make_model(jax.random.key(0))
    options: dict[str, Any] = dict(devices=4, budget="1MiB", optimizer=OPTIMIZER, progress=False)
    return eqxshard.auto_plan(step, model, BATCH, **options)


def test_jit_runs_the_plan_as_the_table_says_and_trains_like_one_device(plan):
    model, opt_state = plan.init(make_model, OPTIMIZER)(jax.random.key(0))
    train_step = plan.jit(step)
    batch = _data()
    compiled = train_step.lower(model, opt_state, batch).compile()
    total = compiled_total(compiled.memory_analysis())
    assert abs(total - plan.chosen.total_bytes) <= 0.01 * total
    one_model = make_model(jax.random.key(0))
    one_state = OPTIMIZER.init(eqx.filter(one_model, eqx.is_array))
    one_step = eqx.filter_jit(step)
    for _ in range(3):
        model, opt_state, loss = train_step(model, opt_state, batch)
        one_model, one_state, one_loss = one_step(one_model, one_state, batch)
        np.testing.assert_allclose(loss, one_loss, rtol=1e-5)
    # The new model and state keep the plan's layout.
    expected = eqxshard.filter_shardings(model, plan.mesh, plan.rules)
    got = jax.tree.map(lambda x: x.sharding, eqx.filter(model, eqx.is_array))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert a.is_equivalent_to(b, 2)


def test_jit_moves_unplaced_inputs_and_evaluates_with_two_arguments(plan):
    model = make_model(jax.random.key(0))
    loss = plan.jit(evaluate)(model, _data())
    np.testing.assert_allclose(loss, evaluate(model, _data()), rtol=1e-5)
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    new_model, _, _ = plan.jit(step)(model, opt_state, _data())
    weight = new_model.layers[0].weight
    want = eqxshard.filter_shardings(model, plan.mesh, plan.rules).layers[0].weight
    assert weight.sharding.is_equivalent_to(want, 2)


def test_apply_places_as_shard_does(plan):
    model = make_model(jax.random.key(0))
    applied = plan.apply(model)
    shard, _, _ = plan.shard(model)
    arrays = lambda tree: jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    assert applied.activation is model.activation  # statics are the same objects
    for a, b in zip(arrays(applied), arrays(shard), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(a, b)


def test_repr_is_python_for_an_equal_plan(plan):
    names = {
        "Plan": eqxshard.Plan,
        "P": P,
        "path_rules": eqxshard.path_rules,
        "fsdp": eqxshard.fsdp,
    }
    pasted = eval(repr(plan), names)
    assert pasted == plan and pasted.table == [] and repr(pasted) == repr(plan)
    assert dict(pasted.mesh.shape) == plan.chosen.mesh_shape
    assert pasted.remat == {} and pasted.offload == () and pasted.pipeline is None
    # What the guide says to paste on the cluster prints, in text and in a notebook; it
    # has no chosen row (no table), and says so.
    shown = str(pasted)
    assert shown == pasted.summary() and "No table of candidates" in shown
    assert "batch P(" in shown and "data=" in shown
    assert "No table of candidates" in pasted._repr_html_()
    with pytest.raises(ValueError, match=r"holds no table of candidates.*auto_plan"):
        _ = pasted.chosen
    other = eqxshard.Plan(
        mesh=dict(plan.mesh.shape),
        rules=plan.rules,
        batch_spec=plan.batch_spec,
        budget=plan.budget,
        offload=("optimizer state",),
    )
    assert other != plan and "offload=('optimizer state',)" in repr(other)
    big = eval(repr(plan).replace(repr(dict(plan.mesh.shape)), "{'data': 64}"), names)
    assert isinstance(big.mesh, AbstractMesh) and big.mesh.size == 64
    # The pasted plan (built over this process's devices) runs.
    x = _data()
    assert np.isfinite(pasted.jit(evaluate)(make_model(jax.random.key(0)), x))


def test_plan_fields_are_checked():
    base: Any = dict(mesh={"data": 2}, rules=P(), batch_spec=P("data"))
    with pytest.raises(TypeError, match=r"`Plan` takes `mesh` as a `Mesh`.*got int"):
        eqxshard.Plan(**(base | {"mesh": 3}))
    with pytest.raises(TypeError, match=r"`Plan` takes `remat` as a dict"):
        eqxshard.Plan(**base, remat=["dots"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`remat` policies \{'blocks': 'some'\}; each is one"):
        eqxshard.Plan(**base, remat={"blocks": "some"})
    with pytest.raises(TypeError, match=r"`Plan` takes `offload` as a tuple"):
        eqxshard.Plan(**base, offload="optimizer state")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`offload` parts \['model'\]; the parts that can"):
        eqxshard.Plan(**base, offload=("model",))
    with pytest.warns(DeprecationWarning, match=r"give the pipeline as `Pipeline"):
        with pytest.raises(ValueError, match=r"`pipeline` as None or an `eqxshard.Pipeline"):
            eqxshard.Plan(**base, pipeline={"stages": 4})


def test_jit_and_apply_errors(plan):
    with pytest.raises(TypeError, match=r"`Plan.jit` takes a callable `step`, but got int"):
        plan.jit(3)
    with pytest.raises(TypeError, match=r"`Plan.jit` takes `donate` as a bool"):
        plan.jit(step, donate="all")
    with pytest.raises(TypeError, match=r"\(model, batch\)` \(evaluation\), but `step` was called"):
        plan.jit(step)(make_model(jax.random.key(0)))
    far = eqxshard.Plan(mesh={"fsdp": 64}, rules=P(), batch_spec=P("fsdp"))
    with pytest.raises(ValueError, match=r"`Plan.jit` needs the devices.*paste `repr\(plan\)`"):
        far.jit(step)
    with pytest.raises(ValueError, match=r"`Plan.apply` needs the devices"):
        far.apply(make_model(jax.random.key(0)))
    remat = eqxshard.Plan(mesh={"data": 2}, rules=P(), batch_spec=P("data"), remat={"b": "dots"})
    with pytest.raises(ValueError, match=r"`Plan.apply` got a plan where `remat` names \['b'\]"):
        remat.apply(make_model(jax.random.key(0)))


def test_loss_is_replicated_scalar(plan):
    model, opt_state = plan.init(make_model, OPTIMIZER)(jax.random.key(0))
    _, _, loss = plan.jit(step)(model, opt_state, _data())
    assert loss.shape == () and loss.sharding.is_equivalent_to(NamedSharding(plan.mesh, P()), 0)


@pytest.mark.heavy  # runs every example of Plan's methods: auto_plan searches
def test_method_examples_run():
    """The `!!! Example` of `Plan.jit` (test_docstrings runs only those of public names)."""
    import inspect
    import re
    import textwrap

    doc = inspect.getdoc(eqxshard.Plan.jit) or ""
    (code,) = re.findall(r"!!! Example\s*\n\s*```python\n(.*?)```", doc, re.S)
    prelude = "import equinox as eqx\nimport jax\nimport jax.numpy as jnp\nimport eqxshard\n"
    exec(compile(prelude + textwrap.dedent(code), "<Plan.jit example>", "exec"), {})
