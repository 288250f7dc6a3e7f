"""Staged host-to-device transfers: big NumPy leaves cut into parts and copied through
pinned host memory, checked to give bit-for-bit what `jax.device_put` gives, within the
staging bound. Each test runs twice: on CPU devices with the path forced on
(`EQXSHARD_STAGING=on`), and on the GPUs under the default `auto`, where it is the real
path (skipped without a GPU; on a GPU machine: `JAX_PLATFORMS=cuda,cpu`)."""

import threading

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import make_mesh, named
from jax.sharding import PartitionSpec as P, SingleDeviceSharding

from eqxshard import filter_put, filter_restore, filter_save, filter_shard
from eqxshard._placement import cache, staging

STAGING_BYTES = 4096  # parts of 1 KiB; leaves of 128 bytes or more per device are staged


def _platform_devices(platform: str) -> list:
    try:
        return jax.devices(platform)
    except RuntimeError:  # that backend is not enabled (JAX_PLATFORMS) or not present
        return []


@pytest.fixture(params=["cpu", "gpu"])
def devices(request, monkeypatch):
    """The devices staged onto: 8 CPU devices with staging forced on, or every GPU with
    the default mode (`auto`), which stages there by itself."""
    found = _platform_devices(request.param)
    if not found:
        pytest.skip("needs a GPU (on a GPU machine: JAX_PLATFORMS=cuda,cpu)")
    monkeypatch.setenv(staging.MODE_VARIABLE, "on" if request.param == "cpu" else "auto")
    return found


def mesh_of(devices, shape, names):
    """A mesh of `shape` over `devices`, or as much of it as they allow: each axis shrunk
    to the largest divisor of its size that fits (so the leaves still split evenly)."""
    full, left = [], len(devices)
    for size in shape:
        fits = max(d for d in range(1, size + 1) if size % d == 0 and d <= left)
        full.append(fits)
        left //= fits
    return make_mesh("auto", full, names, devices=devices[: int(np.prod(full))])


@pytest.fixture
def moves(devices, monkeypatch):
    """Records each part moved, the most bytes staged at once, and whether each part went
    through pinned host memory."""
    monkeypatch.setenv(staging.BYTES_VARIABLE, str(STAGING_BYTES))
    cache.clear()
    record = {"parts": [], "in_flight": 0, "most": 0, "pinned": set()}
    lock = threading.Lock()
    real = staging._move

    def counted(device, part):
        with lock:
            record["parts"].append(part.nbytes)
            record["in_flight"] += part.nbytes
            record["most"] = max(record["most"], record["in_flight"])
            kinds = {m.kind for m in device.addressable_memories()}
            record["pinned"].add("pinned_host" in kinds)
        try:
            return real(device, part)
        finally:
            with lock:
                record["in_flight"] -= part.nbytes

    monkeypatch.setattr(staging, "_move", counted)
    return record


def assert_pinned_on_gpus(devices, moves):
    """On a GPU every part goes through its pinned host memory."""
    if devices[0].platform == "gpu":
        assert moves["pinned"] == {True}, moves["pinned"]


def assert_identical(out, expected):
    """The same array as `jax.device_put` gives: layout, commitment, dtype and bits."""
    assert isinstance(out, jax.Array)
    assert out.sharding == expected.sharding, (out.sharding, expected.sharding)
    assert out.committed and expected.committed
    assert (out.shape, out.dtype) == (expected.shape, expected.dtype)
    for a, b in zip(out.addressable_shards, expected.addressable_shards, strict=True):
        assert a.device == b.device and a.index == b.index
        assert np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes()


def host_leaves():
    rng = np.random.default_rng(0)
    floats = rng.normal(size=(1000, 3)).astype(np.float32)
    floats[0, 0] = np.nan  # bits, not values, are compared
    return {
        "f32": floats,
        "bf16": rng.normal(size=(64, 40)).astype(ml_dtypes.bfloat16),
        "i8": rng.integers(-100, 100, size=(777,)).astype(np.int8),
        "u16": rng.integers(0, 60000, size=(8, 129)).astype(np.uint16),
        "i64": rng.integers(-(2**40), 2**40, size=(301,)),
        "bool": rng.random(1001) > 0.5,
        "c64": (rng.normal(size=(40, 8)) + 1j).astype(np.complex64),
        "columns": rng.normal(size=(64, 64)).astype(np.float32),  # pieces not contiguous
        "empty": np.zeros((0, 5), np.float32),
        "scalar": np.float32(3.5),
        "small": np.arange(3, dtype=np.int32),
    }


def test_staging_is_bit_identical_to_device_put(devices, moves):
    mesh = mesh_of(devices, (8,), ("data",))
    n = mesh.devices.size
    leaves = host_leaves()
    targets = {
        "f32": named(mesh),
        "bf16": named(mesh, "data"),
        "i8": SingleDeviceSharding(devices[min(3, len(devices) - 1)]),
        "u16": named(mesh, "data", None),
        "i64": named(mesh),
        "bool": SingleDeviceSharding(devices[0]),
        "c64": named(mesh, None, "data"),
        "columns": named(mesh, None, "data"),  # (64, 8) a device: 2 KiB, two parts joined
        "empty": named(mesh),
        "scalar": named(mesh),
        "small": named(mesh),
    }
    names = list(leaves)
    out = staging.device_put([leaves[k] for k in names], [targets[k] for k in names])
    expected = jax.device_put([leaves[k] for k in names], [targets[k] for k in names])
    for a, b in zip(out, expected, strict=True):
        assert_identical(a, b)
    # Every big leaf was cut into parts of at most 1 KiB, never more staged at once than
    # the bound; empty, scalar and small leaves went with the plain batched device_put.
    assert len(moves["parts"]) > 12 * n
    assert max(moves["parts"]) <= STAGING_BYTES // staging.IN_FLIGHT
    assert moves["most"] <= STAGING_BYTES
    assert_pinned_on_gpus(devices, moves)


def test_staging_through_filter_shard_and_filter_put(devices, moves):
    mesh = mesh_of(devices, (4, 2), ("data", "model"))
    rng = np.random.default_rng(1)
    tree = {
        "layers": [rng.normal(size=(16, 24)).astype(np.float32) for _ in range(40)],
        "embedding": rng.normal(size=(128, 64)).astype(ml_dtypes.bfloat16),
        "name": "model",
    }
    out = filter_shard(tree, mesh, P("data", "model"))
    again = filter_shard(tree, mesh, P("data", "model"))  # the remembered plan, staged too
    for placed in (out, again):
        assert placed["name"] == "model"
        for a, x in zip(jax.tree.leaves(placed), jax.tree.leaves(tree), strict=True):
            if eqx.is_array(x):
                assert_identical(a, jax.device_put(x, named(mesh, "data", "model")))
    device = devices[min(5, len(devices) - 1)]
    put = filter_put(tree, device)
    for a, x in zip(jax.tree.leaves(put), jax.tree.leaves(tree), strict=True):
        if eqx.is_array(x):
            assert_identical(a, jax.device_put(x, device))
    assert moves["parts"], "nothing was staged"
    assert moves["most"] <= STAGING_BYTES
    assert_pinned_on_gpus(devices, moves)


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_staged_only_onto_accelerators_unless_forced(devices, moves, monkeypatch, mode):
    monkeypatch.setenv(staging.MODE_VARIABLE, mode)
    mesh = mesh_of(devices, (8,), ("data",))
    x = np.arange(4096, dtype=np.float32)
    (out,) = staging.device_put([x], [named(mesh)])
    assert_identical(out, jax.device_put(x, named(mesh)))
    staged = mode == "auto" and devices[0].platform != "cpu"
    assert bool(moves["parts"]) == staged, moves["parts"]


@pytest.mark.parametrize(
    ("variable", "value", "match"),
    [
        (staging.MODE_VARIABLE, "fast", r"EQXSHARD_STAGING='fast' is not one of \['auto'"),
        (staging.BYTES_VARIABLE, "1GB", r"EQXSHARD_STAGING_BYTES='1GB' is not a positive"),
        (staging.BYTES_VARIABLE, "0", r"EQXSHARD_STAGING_BYTES='0' is not a positive"),
    ],
)
def test_bad_settings_raise(monkeypatch, variable, value, match):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=match):
        filter_shard({"x": np.ones(8)}, jax.devices()[0])


def test_restore_reads_to_host_and_stages(devices, moves, monkeypatch, tmp_path):
    """`filter_restore` onto staged devices: read as host NumPy, then staged; the same
    arrays as a restore straight onto the devices."""
    mesh = mesh_of(devices, (4, 2), ("data", "model"))
    rng = np.random.default_rng(2)
    tree = {
        "w": rng.normal(size=(64, 48)).astype(np.float32),
        "e": rng.normal(size=(40, 16)).astype(ml_dtypes.bfloat16),
        "key": jax.random.split(jax.random.key(3), 8),
        "step": 7,
    }
    filter_save(tmp_path, 0, tree)
    staged = filter_restore(tmp_path, tree, mesh, P("data"))
    assert moves["parts"], "nothing was staged"
    assert moves["most"] <= STAGING_BYTES
    assert_pinned_on_gpus(devices, moves)
    monkeypatch.setenv(staging.MODE_VARIABLE, "off")
    direct = filter_restore(tmp_path, tree, mesh, P("data"))
    assert staged["step"] == 7
    for name in ("w", "e"):
        assert_identical(staged[name], direct[name])
    assert staged["key"].dtype == direct["key"].dtype
    assert (jax.random.key_data(staged["key"]) == jax.random.key_data(direct["key"])).all()
