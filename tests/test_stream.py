import functools as ft
import io
import sys
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from eqxshard import filter_stream

ACTIVATION = jnp.tanh


def _exact(params, x, key, label):
    """Correctly rounded ops only (no a*b+c, which XLA may fuse): results match exactly."""
    noise = (jax.random.bits(key, x.shape) % 8).astype(x.dtype)
    y = (x + noise + params["shift"]) * params["scale"]
    return {"y": y, "peak": jnp.max(y), "shift": params["shift"]}, label, ACTIVATION


def _inputs(n):
    params = {"scale": jnp.float32(1.5), "shift": jnp.arange(3.0)}
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3) / 7
    keys = jax.random.split(jax.random.key(0), n)
    return params, x, keys, "label"


IN_AXES = (None, 0, 0, None)
OUT_AXES = ({"y": 0, "peak": 0, "shift": None}, None, None)
CASES = [(n, b) for n in (0, 1, 7, 64) for b in sorted({1, 3, n - 1, n, n + 1} - {-1, 0})]


@pytest.mark.parametrize("n,batch_size", CASES)
def test_equals_filter_vmap(n, batch_size):
    args = _inputs(n)
    ref = eqx.filter_vmap(_exact, in_axes=IN_AXES, out_axes=OUT_AXES)(*args)
    out = filter_stream(
        _exact, batch_size=batch_size, in_axes=IN_AXES, out_axes=OUT_AXES, progress=False
    )(*args)
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    for key in ("y", "peak", "shift"):
        assert type(out[0][key]) is np.ndarray
        assert out[0][key].shape == ref[0][key].shape
        np.testing.assert_array_equal(out[0][key], ref[0][key])
    assert out[1] is args[3] and out[2] is ACTIVATION


class Rows:
    """A host object that is not an array: `len` and `[i:j]` only. Records what is live on
    the devices each time a chunk is read."""

    def __init__(self, data, batch_size):
        self.data, self.batch_size, self.reads, self.live = data, batch_size, [], []

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        self.reads.append((index.start, index.stop))
        chunk_shape = (self.batch_size, *self.data.shape[1:])
        # Keep shardings, not the arrays: holding them would keep them alive.
        self.live.append([a.sharding for a in jax.live_arrays() if a.shape == chunk_shape])
        return self.data[index]


MESHES = {
    "none": None,
    "explicit": ((8,), ("rows",), (AxisType.Explicit,)),
    "auto-2d": ((4, 2), ("rows", "cols"), (AxisType.Auto, AxisType.Auto)),
}


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_chunks_on_devices_and_one_compile(mesh_name):
    spec = MESHES[mesh_name]
    mesh = None if spec is None else jax.make_mesh(spec[0], spec[1], axis_types=spec[2])
    data = np.random.default_rng(0).normal(size=(100, 13, 17)).astype(np.float32)
    rows = Rows(data, 16)
    traces = []

    def f(w, x):
        traces.append(x.shape)
        return jnp.sum(x * w, axis=-1)

    out = filter_stream(f, batch_size=16, in_axes=(None, 0), mesh=mesh, progress=False)(
        np.float32(2.0), rows
    )
    np.testing.assert_allclose(out, np.sum(data * 2, axis=-1), rtol=1e-5, atol=1e-5)
    assert len(traces) == 1  # the last chunk (4 rows) is padded: one trace, one compile
    assert rows.reads == [(s, min(100, s + 16)) for s in range(0, 100, 16)]
    assert max(len(live) for live in rows.live) <= 2  # never more than ~2 chunks on devices
    assert max(len(live) for live in rows.live[1:]) >= 1  # chunk j+1 is read while j runs
    for sharding in (s for live in rows.live for s in live):
        if mesh is None:
            assert len(sharding.device_set) == 1
        else:
            assert sharding.is_equivalent_to(NamedSharding(mesh, P(tuple(mesh.axis_names))), 3)


def test_other_axes_and_device_inputs():
    x = np.arange(24.0, dtype=np.float32).reshape(3, 8)  # streamed along axis 1
    keys = jax.random.split(jax.random.key(3), 8)  # a JAX array on the device
    f = lambda x, k: x * jax.random.uniform(k)  # noqa: E731
    ref = eqx.filter_vmap(f, in_axes=(1, 0), out_axes=-1)(x, keys)
    out = filter_stream(f, batch_size=3, in_axes=(1, 0), out_axes=-1, progress=False)(x, keys)
    assert out.shape == (3, 8)
    np.testing.assert_array_equal(out, ref)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_label(monkeypatch):
    def square(x):
        return x**2

    cases: list[tuple[Callable[..., Any], str | None, str]] = [
        (square, None, "square"),
        (lambda x: x + 1, None, "filter_stream"),
        (ft.partial(jnp.add, 1), None, "filter_stream"),
        (lambda x: x + 1, "scoring", "scoring"),
    ]
    for fun, desc, label in cases:
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        filter_stream(fun, batch_size=4, desc=desc)(np.zeros(10))
        written = terminal.getvalue()
        assert f"{label}: 100%" in written and "10/10" in written
        assert "<lambda>" not in written


def test_progress_bar_silent_off_terminal(capfd):
    # `disable=None`: a log file or a pipe gets no `\r` updates at all.
    filter_stream(lambda x: x + 1, batch_size=4)(np.zeros(10))
    assert capfd.readouterr().err == ""
    monkeypatch_free = _Terminal()
    sys_stderr, sys.stderr = sys.stderr, monkeypatch_free
    try:
        filter_stream(lambda x: x + 1, batch_size=4, progress=False)(np.zeros(10))
    finally:
        sys.stderr = sys_stderr
    assert monkeypatch_free.getvalue() == ""


def test_decorator():
    @filter_stream(batch_size=4, progress=False)
    def double(x):
        return 2 * x

    np.testing.assert_array_equal(double(np.arange(9.0)), 2 * np.arange(9.0))
    assert double.__name__ == "double"


# ---- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [None, 2.0, True])
def test_batch_size_type_error(bad):
    with pytest.raises(TypeError, match=r"batch_size=\.\.\.\)` must be a positive int"):
        filter_stream(jnp.sin, batch_size=bad)


def test_batch_size_value_error():
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        filter_stream(jnp.sin, batch_size=0)


def test_batch_size_not_multiple_of_mesh():
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(AxisType.Explicit,))
    with pytest.raises(ValueError, match="multiple of the 8 devices.*batch_size=16"):
        filter_stream(jnp.sin, batch_size=10, mesh=mesh)(np.zeros(20))


def test_mesh_type_error():
    with pytest.raises(TypeError, match=r"mesh=\.\.\.\)` must be a `jax.sharding.Mesh`"):
        filter_stream(jnp.sin, batch_size=2, mesh="rows")(np.zeros(4))  # type: ignore[arg-type]


def test_traced_arguments_rejected():
    f = filter_stream(jnp.sin, batch_size=2)
    with pytest.raises(TypeError, match=r"runs outside `jax.jit`.*args\.0"):
        jax.jit(f)(jnp.zeros(4))


def test_nothing_to_stream():
    with pytest.raises(ValueError, match="nothing to stream"):
        filter_stream(lambda s: s, batch_size=2)("text")


def test_different_row_counts_listed():
    with pytest.raises(ValueError, match=r"same number of rows.*\n  args\.0\s+4 rows\n  args\.1"):
        filter_stream(lambda x, y: x, batch_size=2)(np.zeros(4), np.zeros(5))


def test_unsliceable_leaf_listed():
    with pytest.raises(TypeError, match=r"do not fit:\n  args\.1  int  in_axes 0"):
        filter_stream(lambda x, y: x, batch_size=2, in_axes=0)(np.zeros(4), 3)


def test_other_axis_needs_an_array():
    rows = Rows(np.zeros((4, 2)), 2)
    with pytest.raises(TypeError, match=r"args\.0  Rows  in_axes 1"):
        filter_stream(lambda x: x, batch_size=2, in_axes=1)(rows)


def test_keyword_arguments_and_fun_type():
    with pytest.raises(TypeError, match="positional arguments only"):
        filter_stream(lambda x: x, batch_size=2)(x=np.zeros(2))
    with pytest.raises(TypeError, match="must be callable"):
        filter_stream(3, batch_size=2)  # type: ignore[arg-type]


# ---- compiled once, across calls ------------------------------------------------------

_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration_secs, **kwargs: (
        _COMPILES.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
    )
)


@pytest.mark.parametrize("mesh_name", ["none", "explicit"])
def test_second_call_compiles_nothing(mesh_name):
    spec = MESHES[mesh_name]
    mesh = None if spec is None else jax.make_mesh(spec[0], spec[1], axis_types=spec[2])
    model = eqx.nn.MLP(3, 2, 8, 1, activation=jax.nn.gelu, key=jax.random.key(0))
    traces = []

    def predict(model, x, label):
        traces.append(label)
        return model(x), label

    stream = filter_stream(
        predict, batch_size=8, in_axes=dict(model=None), mesh=mesh, progress=False
    )
    rng = np.random.default_rng(0)
    first = rng.normal(size=(20, 3)).astype(np.float32)
    del _COMPILES[:]
    stream(model, first, "a")
    assert _COMPILES and len(traces) == 1  # the counter sees compiles
    for _ in range(2):
        data = rng.normal(size=(20, 3)).astype(np.float32)
        del _COMPILES[:]
        out, label = stream(model, data, "a")
        assert _COMPILES == [] and len(traces) == 1
        assert label == "a"
        np.testing.assert_allclose(out, jax.vmap(model)(jnp.asarray(data)), rtol=1e-5, atol=1e-6)
    # A different static leaf, a different model (same shapes) and a different row count.
    stream(model, first, "b")
    assert len(traces) == 2
    other = eqx.nn.MLP(3, 2, 8, 1, activation=jax.nn.gelu, key=jax.random.key(1))
    del _COMPILES[:]
    out, _ = stream(other, first, "a")
    assert _COMPILES == [] and len(traces) == 2
    np.testing.assert_allclose(out, jax.vmap(other)(jnp.asarray(first)), rtol=1e-5, atol=1e-6)
    stream(model, first[:5], "a")  # padded to one chunk of 8 either way: no new trace
    assert len(traces) == 2
    stream(model, first.astype(np.float16), "a")  # another dtype: a new trace
    assert len(traces) == 3


def test_unhashable_static_still_works():
    class Unhashable:
        # Unhashable on purpose (the way Python documents; typeshed types `__hash__` a method).
        __hash__ = None  # pyright: ignore[reportAssignmentType]

        def __init__(self, k):
            self.k = k

    stream = filter_stream(lambda x, u: x * u.k, batch_size=4, progress=False)
    np.testing.assert_array_equal(stream(np.arange(6.0), Unhashable(2)), 2 * np.arange(6.0))
    np.testing.assert_array_equal(stream(np.arange(6.0), Unhashable(3)), 3 * np.arange(6.0))


class RecordedRows:
    """An h5py-like dataset: `shape`, `dtype` and row slicing, recording each read."""

    def __init__(self, data: np.ndarray):
        self.data, self.shape, self.dtype = data, data.shape, data.dtype
        self.reads: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, _ = rows.indices(len(self.data))
        self.reads.append((start, stop))
        return self.data[rows]


@pytest.mark.parametrize(("start", "stop"), [(0, 8), (16, 21), (24, 25)])
@pytest.mark.parametrize("spec", [P("data"), P(("data", "model"))])
def test_rows_from_host_reads_only_each_devices_rows(start, stop, spec):
    """The path a mesh over several processes takes (each process fills its own devices):
    the same array as `device_put` of the padded chunk, and every read is one device's."""
    from eqxshard._mapping.stream_host import host_chunk, rows_from_host

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    data = np.arange(25 * 3, dtype=np.float32).reshape(25, 3)
    leaf = RecordedRows(data)
    sharding = NamedSharding(mesh, spec)
    out = rows_from_host(leaf, start, stop, 8, sharding)
    expected = jax.device_put(host_chunk(data, start, stop, 8), sharding)
    assert out.sharding == expected.sharding and out.dtype == expected.dtype
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    indices = sharding.addressable_devices_indices_map((8, 3)).values()
    held = {(start + (i[0].start or 0), start + (i[0].stop or 8)) for i in indices if i}
    pad_read = (stop - 1, stop)  # the last row, repeated where a device's rows pass it
    for read in leaf.reads:
        inside = any(a <= read[0] and read[1] <= min(b, stop) for a, b in held)
        assert inside or read == pad_read, (read, held)
    assert len(leaf.reads) >= len(held)
