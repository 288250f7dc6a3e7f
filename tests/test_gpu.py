"""Placement on a real GPU: CPU -> GPU and back, sharding a model, a sharded training step.

Skipped where JAX has no GPU. `conftest.py` makes JAX_PLATFORMS default to "cpu", so on a
GPU machine run these with the GPU (and the CPU, for the round trips) enabled:

    JAX_PLATFORMS=cuda,cpu python -m pytest tests/test_gpu.py
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    Device,
    assert_equal_value,
    assert_placed,
    assert_statics_same,
    make_model,
    mesh_on,
    named,
)
from jax.sharding import PartitionSpec as P, SingleDeviceSharding

import eqxshard
from eqxshard import _compat


def _devices(platform: str) -> list[Device]:
    try:
        return jax.devices(platform)
    except RuntimeError:  # that backend is not enabled (JAX_PLATFORMS) or not present
        return []


HAS_GPU = any(d.platform == "gpu" for d in jax.devices())

pytestmark = pytest.mark.skipif(
    not HAS_GPU, reason="needs a GPU (on a GPU machine: JAX_PLATFORMS=cuda,cpu)"
)
needs_cpu = pytest.mark.skipif(
    not _devices("cpu"), reason="needs the CPU backend beside the GPU (JAX_PLATFORMS=cuda,cpu)"
)


def _gpus() -> list[Device]:
    return _devices("gpu")


def _array_pairs(out: Any, tree: Any) -> list[tuple[Any, Any]]:
    assert_statics_same(out, tree)
    pairs = zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True)
    return [(x, ref) for x, ref in pairs if eqx.is_array(ref)]


@needs_cpu
def test_model_cpu_to_gpu_and_back() -> None:
    cpu, gpu = _devices("cpu")[0], _gpus()[0]
    model = eqxshard.filter_put(make_model(), cpu)
    for x, _ in _array_pairs(model, model):
        assert x.sharding.device_set == {cpu}

    on_gpu = eqxshard.filter_put(model, "gpu")
    for x, ref in _array_pairs(on_gpu, model):
        assert_placed(x, SingleDeviceSharding(gpu), ref)

    back = eqxshard.filter_put(on_gpu, cpu)
    for x, ref in _array_pairs(back, model):
        assert_placed(x, SingleDeviceSharding(cpu), ref)

    host = eqxshard.filter_get(on_gpu)
    np.testing.assert_array_equal(host.linear.weight, np.asarray(model.linear.weight))
    assert host.fn is model.fn


@needs_cpu
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_filter_shard_cpu_model_onto_a_gpu_mesh(kind: str) -> None:
    gpus = _gpus()
    mesh = mesh_on(kind, gpus)
    model = eqxshard.filter_put(make_model(), _devices("cpu")[0])
    batch = eqxshard.filter_put(np.arange(8.0 * len(gpus) * 8).reshape(-1, 8), "cpu")

    sharded = eqxshard.filter_shard(model, mesh)
    for x, ref in _array_pairs(sharded, model):
        assert_placed(x, named(mesh), ref)
    rows = eqxshard.filter_shard(batch, mesh, P("data"))
    assert_placed(rows, named(mesh, "data"), batch)
    assert isinstance(rows, jax.Array)  # typed as the NumPy batch it was made from
    assert {d.platform for d in rows.sharding.device_set} == {"gpu"}

    back = eqxshard.filter_shard(sharded, _devices("cpu")[0])
    for x, ref in _array_pairs(back, model):
        assert_placed(x, SingleDeviceSharding(_devices("cpu")[0]), ref)


@pytest.mark.parametrize("memory_kind", ["pinned_host", "unpinned_host"])
def test_gpu_memory_kinds_there_and_back(memory_kind: str) -> None:
    gpus = _gpus()
    mesh = mesh_on("explicit", gpus)
    model = eqxshard.filter_shard(make_model(), mesh)
    available = {m.kind for m in gpus[0].addressable_memories()}
    if memory_kind not in available:
        with pytest.raises(ValueError, match="which these leaves' target devices do not have"):
            eqxshard.filter_put(model, memory_kind=memory_kind)
        return
    off = eqxshard.filter_put(model, memory_kind=memory_kind)
    for x, ref in _array_pairs(off, model):
        assert x.sharding.memory_kind == memory_kind
        assert_placed(x, ref.sharding.with_memory_kind(memory_kind), ref)
    back = eqxshard.filter_put(off, memory_kind="device")
    for x, ref in _array_pairs(back, model):
        assert x.sharding.memory_kind == "device"
        assert_placed(x, ref.sharding, ref)


def test_gpu_offload_inside_jit() -> None:
    mesh = mesh_on("auto", _gpus())
    x = eqxshard.filter_shard(jnp.arange(8.0 * len(_gpus())), mesh, P("data"))

    @jax.jit
    def offload_and_back(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        host = eqxshard.filter_put(x, memory_kind="pinned_host")
        return host, eqxshard.filter_put(host, memory_kind="device") * 2

    host, doubled = offload_and_back(x)
    assert host.sharding.memory_kind == "pinned_host"
    assert_placed(host, named(mesh, "data").with_memory_kind("pinned_host"), x)
    assert doubled.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(doubled), 2 * np.asarray(x))


@needs_cpu
def test_moving_a_gpu_leaf_to_the_cpu_inside_jit_is_an_error() -> None:
    mesh = mesh_on("explicit", _gpus())
    x = eqxshard.filter_shard({"w": jnp.ones((len(_gpus()), 2))}, mesh, P("data"))
    with pytest.raises(ValueError, match="cannot move these traced leaves to a device") as info:
        jax.jit(lambda t: eqxshard.filter_put(t, _devices("cpu")[0]))(x)
    assert "\n  w" in str(info.value) and "outside `jit`" in str(info.value)


def _loss(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _make_step(optimizer: optax.GradientTransformation, mesh: Any) -> Any:
    @eqx.filter_jit
    def step(model: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        if mesh is not None:
            x, y = eqxshard.filter_shard((x, y), mesh, P("data"))
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        if mesh is not None:
            model, opt_state = eqxshard.filter_replicate((model, opt_state), mesh)
        return model, opt_state, loss

    return step


@needs_cpu
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_sharded_training_step_matches_the_cpu(kind: str) -> None:
    """Data-parallel steps over every GPU give the same model as unsharded steps on CPU."""
    gpus, cpu = _gpus(), _devices("cpu")[0]
    mesh = mesh_on(kind, gpus)
    batch = 4 * len(gpus)
    kx, ky, km = jax.random.split(jax.random.key(0), 3)
    x = np.asarray(jax.random.normal(kx, (batch, 8)))
    y = np.asarray(jax.random.normal(ky, (batch, 2)))
    model = eqx.nn.MLP(8, 2, 16, 2, activation=jax.nn.tanh, key=km)
    optimizer = optax.adam(1e-2)

    with jax.default_matmul_precision("highest"):
        ref_model = eqxshard.filter_put(model, cpu)
        ref_state = optimizer.init(eqx.filter(ref_model, eqx.is_array))
        ref_step = _make_step(optimizer, None)
        gpu_model = eqxshard.filter_replicate(model, mesh)
        gpu_state = eqxshard.filter_replicate(optimizer.init(eqx.filter(model, eqx.is_array)), mesh)
        gpu_step = _make_step(optimizer, mesh)
        ref_loss = gpu_loss = None
        for _ in range(3):
            ref_model, ref_state, ref_loss = ref_step(ref_model, ref_state, x, y)
            gpu_model, gpu_state, gpu_loss = gpu_step(gpu_model, gpu_state, x, y)

    assert ref_loss is not None and gpu_loss is not None
    np.testing.assert_allclose(float(gpu_loss), float(ref_loss), rtol=1e-5)
    for g, r in _array_pairs(gpu_model, ref_model):
        assert_placed(g, named(mesh))
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)
    for g, r in zip(jax.tree.leaves(gpu_state), jax.tree.leaves(ref_state), strict=True):
        assert {d.platform for d in g.sharding.device_set} == {"gpu"}
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)
    assert gpu_model.activation is model.activation
    host = eqxshard.filter_get(gpu_model)
    assert_equal_value(host.layers[0].weight, np.asarray(gpu_model.layers[0].weight))


@needs_cpu
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_moving_to_a_cpu_mesh_inside_jit_is_an_error(kind: str) -> None:
    """Same device count, other backend: eqxshard names the leaf where JAX exposes the
    platform of a traced array (jax >= 0.8); older JAX rejects the program when compiling."""
    gpus, cpus = _gpus(), _devices("cpu")
    if len(cpus) < len(gpus):
        pytest.skip("needs at least as many CPU devices as GPUs")
    gpu_mesh, cpu_mesh = mesh_on(kind, gpus), mesh_on(kind, cpus[: len(gpus)])
    x = eqxshard.filter_shard({"w": jnp.ones((len(gpus), 2))}, gpu_mesh, P("data"))
    move = jax.jit(lambda t: eqxshard.filter_shard(t, cpu_mesh, P("data")))
    if _compat.mesh_platform(gpu_mesh.abstract_mesh) == "gpu":
        with pytest.raises(ValueError, match="another device set inside `jit`") as info:
            move(x)
        assert "\n  w" in str(info.value) and "asked for" in str(info.value)
    else:
        with pytest.raises(Exception, match="incompatible devices"):
            move(x)
