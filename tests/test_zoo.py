"""The zoo (`tests/zoo/`): small Equinox models of the kinds real ones are made of, each
put through what a new user does with eqxshard: placement, `fsdp`, `auto_plan`, a
`filter_jit` training step on 8 devices against the same step on one device, a
checkpoint restored onto another layout, and `filter_map`, on Auto and Explicit meshes.

On Explicit mesh axes JAX (or Equinox) refuses some of these models; there the tests pin
the error a user gets, so a change in what works there is seen."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from helpers import assert_tree_values, compiled_total
from jax.sharding import AxisType, PartitionSpec as P
from zoo.models import ZOO, Zoo

import eqxshard

OPTIMIZER = optax.sgd(1e-2, momentum=0.9)  # its state mirrors the parameters
FSDP = eqxshard.fsdp("data", min_size=64)  # small enough that the zoo's weights split
ROWS = 16
STEPS = 2
ROOT = Path(__file__).resolve().parent.parent
JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:2])

# An `eqx.nn.Embedding` lookup of a row-split batch on Explicit axes: JAX asks for the
# gather's `out_sharding=`. `filter_jit` traces with its `mesh=` in context, so jax 0.12
# says so too; jax 0.7.2 fails first on the lookup's dynamic slice with a mesh it does not
# find, also with the mesh set (`jax.set_mesh`): JAX's own error there, pinned. (0.8 and
# 0.9 are not measured: either.)
GATHER = r"out_sharding=\).*gather indexing"
NOT_FOUND = r"Resource axis: data of (?:P|PartitionSpec)\('data'.* is not found in mesh"
LOOKUP = (
    GATHER
    if JAX_VERSION >= (0, 10)
    else NOT_FOUND
    if JAX_VERSION < (0, 8)
    else "|".join((GATHER, NOT_FOUND))
)
# `filter_map` takes no mesh: as `jax.jit` and `eqx.filter_jit` without `jax.set_mesh`,
# jax 0.12 (and 0.7.2) looks the Explicit axis up in the empty context mesh.
LOOKUP_MAP = GATHER if (0, 10) <= JAX_VERSION < (0, 11) else "|".join((GATHER, NOT_FOUND))
# What a step raises on Explicit axes, by model and layout (data parallel: weights
# replicated; fsdp: weights split), measured on jax 0.10.2 and 0.12; `None`: it trains.
EXPLICIT = {
    ("tied_attention", "dp"): LOOKUP,
    ("tied_attention", "fsdp"): LOOKUP,
    ("scanned_stack", "dp"): None,
    ("scanned_stack", "fsdp"): r"carry input and carry output must have equal types",
    # BatchNorm's `state.set`: the new statistics' type carries a sharding the old lacks.
    ("conv_batchnorm", "dp"): r"Old and new values have different structures/shapes/dtypes",
    ("conv_batchnorm", "fsdp"): r"out_sharding` parameter of `conv_general_dilated",
}
# The same for `filter_map` of a prediction over rows split over "data" (inference mode:
# BatchNorm reads its running statistics, so no `state.set`).
EXPLICIT_MAP = {"tied_attention": LOOKUP_MAP, "scanned_stack": None, "conv_batchnorm": None}
MEASURED = JAX_VERSION >= (0, 10)  # older releases may refuse less or more: either is checked


def mesh_of(kind: str, shape: tuple[int, ...] = (8,), names: tuple[str, ...] = ("data",)):
    types = (AxisType.Auto if kind == "auto" else AxisType.Explicit,) * len(shape)
    return jax.make_mesh(shape, names, axis_types=types)


def make_step(zoo: Zoo):
    def step(model, state, opt_state, batch, key):
        grad = eqx.filter_value_and_grad(zoo.loss, has_aux=True)
        (loss, state), grads = grad(model, state, batch, key)
        params = eqx.filter(model, eqx.is_array)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), state, opt_state, loss

    return step


def train(step, model, state, opt_state, batch) -> list[float]:
    losses = []
    for i in range(STEPS):
        model, state, opt_state, loss = step(model, state, opt_state, batch, jax.random.key(i))
        losses.append(float(loss))
    return losses


_REFERENCE: dict[str, list[float]] = {}


def one_device_losses(zoo: Zoo) -> list[float]:
    """The losses of `STEPS` steps on one device (as `eqx.filter_jit` runs them)."""
    if zoo.name not in _REFERENCE:
        model, state = zoo.make(jax.random.key(0))
        opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
        step = eqx.filter_jit(make_step(zoo))
        _REFERENCE[zoo.name] = train(step, model, state, opt_state, zoo.batch(ROWS))
    return _REFERENCE[zoo.name]


def split_leaves(tree: Any) -> list[str]:
    return [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
        if not leaf.sharding.is_fully_replicated
    ]


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("zoo", ZOO, ids=repr)
def test_placement(zoo, kind):
    mesh = mesh_of(kind)
    model, state = zoo.make(jax.random.key(0))
    placed = eqxshard.filter_shard(model, mesh, FSDP)
    assert split_leaves(placed), "fsdp with this min_size should split some weights"
    for path, leaf in jax.tree_util.tree_leaves_with_path(eqx.filter(placed, eqx.is_array)):
        assert leaf.sharding.mesh == mesh, jax.tree_util.keystr(path)
    # The same values; non-array leaves (activations, Shared's `where`/`get`) the same objects.
    assert_tree_values(placed, model)
    replicated = eqxshard.filter_replicate((model, state), mesh)
    assert_tree_values(replicated, (model, state))
    assert not split_leaves(replicated)
    arrays = jax.tree.leaves(eqx.filter(replicated, eqx.is_array))
    assert all(leaf.sharding.mesh == mesh for leaf in arrays)


@pytest.mark.parametrize("layout", ["dp", "fsdp"])
@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("zoo", ZOO, ids=repr)
def test_training_step_on_8_devices_matches_one(zoo, kind, layout):
    mesh = mesh_of(kind)
    rule = FSDP if layout == "fsdp" else P()
    model, state = zoo.make(jax.random.key(0))
    model = eqxshard.filter_shard(model, mesh, rule)
    params = eqx.filter(model, eqx.is_array)
    opt_state = eqxshard.filter_shard(OPTIMIZER.init(params), mesh, eqxshard.like(params))
    if layout == "fsdp":
        assert split_leaves(model) and split_leaves(opt_state)
    step = eqxshard.filter_jit(
        make_step(zoo),
        in_shardings=(None, None, None, P("data"), None),  # the batch split by rows
        out_shardings=(rule, None, eqxshard.like(params), P()),
        mesh=mesh,
    )
    expected_error = EXPLICIT[zoo.name, layout] if kind == "explicit" else None
    try:
        losses = train(step, model, state, opt_state, zoo.batch(ROWS))
    except Exception as e:  # what the user gets on an Explicit mesh
        assert expected_error is not None, f"{zoo.name} failed on {kind} axes: {e}"
        assert re.search(expected_error, str(e), re.S), str(e)
        if "out_sharding" in str(e):  # JAX's ShardingTypeError: filter_jit's note
            notes = "".join(getattr(e, "__notes__", ()))
            assert "eqxshard: this step runs on a mesh with Explicit axes ('data')" in notes
            assert "axis_types=(jax.sharding.AxisType.Auto,)" in notes
        return
    assert expected_error is None or not MEASURED, f"expected JAX to refuse: {expected_error}"
    np.testing.assert_allclose(losses, one_device_losses(zoo), rtol=2e-5)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("zoo", ZOO, ids=repr)
def test_checkpoint_restored_onto_another_layout(zoo, kind, tmp_path):
    mesh = mesh_of(kind)
    model, state = zoo.make(jax.random.key(0))
    saved = eqxshard.filter_shard((model, state), mesh, FSDP)
    eqxshard.filter_save(tmp_path, 1, saved)
    # A restore on a new mesh from the constructor alone: nothing allocated but the result.
    abstract = eqx.filter_eval_shape(zoo.make, jax.random.key(0))
    grid = mesh_of(kind, (2, 4), ("data", "model"))
    rule = eqxshard.fsdp("model", min_size=64)
    restored = eqxshard.filter_restore(tmp_path, abstract, grid, rule)
    plan = eqxshard.filter_shardings(abstract, grid, rule)
    leaves = jax.tree.leaves(eqx.filter(restored, eqx.is_array))
    shardings = jax.tree.leaves(plan, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    originals = jax.tree.leaves(eqx.filter((model, state), eqx.is_array))
    assert len(leaves) == len(shardings) == len(originals)
    for leaf, sharding, original in zip(leaves, shardings, originals, strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.sharding, sharding)
        np.testing.assert_array_equal(leaf, original)
    assert any("model" in str(leaf.sharding.spec) for leaf in leaves)  # really relaid out


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("zoo", ZOO, ids=repr)
def test_filter_map_in_chunks_matches_vmap(zoo, kind):
    mesh = mesh_of(kind)
    model, state = zoo.make(jax.random.key(0))
    batch = zoo.batch(ROWS)
    expected = jax.vmap(lambda row: zoo.predict(model, state, row))(batch)
    model, state = eqxshard.filter_replicate((model, state), mesh)
    split = eqxshard.filter_shard(batch, mesh, P("data"))
    predict = eqxshard.filter_map(lambda row: zoo.predict(model, state, row), batch_size=8)
    expected_error = EXPLICIT_MAP[zoo.name] if kind == "explicit" else None
    try:
        got = predict(split)  # 2 chunks of 8 rows, each row on its own device
    except Exception as e:
        assert expected_error is not None, f"{zoo.name} failed on {kind} axes: {e}"
        assert re.search(expected_error, str(e), re.S), str(e)
        return
    assert expected_error is None or not MEASURED, f"expected JAX to refuse: {expected_error}"
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# On every JAX the cheapest model's search; the others once, in the tests part (heavy).
@pytest.mark.parametrize(
    "zoo",
    [z if z.name == "conv_batchnorm" else pytest.param(z, marks=pytest.mark.heavy) for z in ZOO],
    ids=repr,
)
def test_auto_plan_chooses_an_auto_mesh_that_trains(zoo):
    model, state = zoo.make(jax.random.key(0))
    batch = zoo.batch(ROWS)

    def step(model, opt_state, batch):  # auto_plan's form; the state is a constant here
        (loss, _), grads = eqx.filter_value_and_grad(zoo.loss, has_aux=True)(
            model, state, batch, jax.random.key(0)
        )
        params = eqx.filter(model, eqx.is_array)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    plan = eqxshard.auto_plan(
        step, model, batch, devices=2, budget="8MiB", optimizer=OPTIMIZER, progress=False
    )
    chosen = plan.chosen
    assert chosen.fits and chosen.total_bytes is not None and chosen.total_bytes <= 8 * 2**20
    assert set(plan.mesh.axis_types) == {AxisType.Auto}  # what most Equinox models need
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_array))
    _, _, expected = eqx.filter_jit(step)(model, opt_state, batch)
    placed = plan.shard(model, opt_state, batch)
    _, _, loss = eqxshard.filter_jit(step)(*placed)
    np.testing.assert_allclose(loss, expected, rtol=2e-5)
    # The chosen row's bytes per device are those of the plan's own step, compiled.
    total = compiled_total(plan.jit(step).lower(*placed).compile().memory_analysis())
    assert abs(total - chosen.total_bytes) <= 0.01 * total


# `jnp.fft.rfft` of an operand split over devices inside `jit`, broadcast against another
# FFT: XLA's CPU backend fails the run (jax 0.10.2: "RET_CHECK failure ... fft_thunk.cc"
# when the result is read; some releases abort the process), jax 0.12 runs it. In a
# subprocess, since it may abort. docs/troubleshooting.md shows the workaround.
FFT = """
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import eqxshard

four = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
kernel = jax.device_put(jnp.ones((64, 16)), NamedSharding(four, P("d")))
WORKAROUND = {workaround}

def fft_conv(x, k):
    if WORKAROUND:
        k = eqxshard.filter_shard(k, four, P())
    spectrum = jnp.fft.rfft(x, n=32) * jnp.fft.rfft(k, n=32)[None]
    return jnp.fft.irfft(spectrum, n=32).sum()

print("result", float(jax.jit(fft_conv)(jnp.ones((16, 64, 16)), kernel)))
"""


def _run_fft(workaround: bool) -> subprocess.CompletedProcess:
    code = textwrap.dedent(FFT).format(workaround=workaround)
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


@pytest.mark.heavy
def test_fft_of_a_split_operand_fails_on_cpu_and_the_workaround_runs():
    unsplit = 16 * 64 * 16 * 16.0  # the same sum on one device
    fixed = _run_fft(workaround=True)
    assert fixed.returncode == 0, fixed.stderr
    assert f"result {unsplit}" in fixed.stdout
    bug = _run_fft(workaround=False)
    if bug.returncode == 0 and f"result {unsplit}" in bug.stdout:
        assert JAX_VERSION >= (0, 12), "jax 0.10 fails here: did the bug go away?"
    else:  # the XLA bug the troubleshooting page describes, and no other failure
        assert "fft_thunk.cc" in bug.stderr and "RET_CHECK" in bug.stderr, bug.stderr[-2000:]
