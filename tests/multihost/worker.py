"""One process of a real multi-host run: 2 processes x 4 CPU devices on 127.0.0.1.

`test_multihost.py` starts two of these per group of scenarios:

    python worker.py PORT PROCESS_ID NUM_PROCESSES GROUP

Each process joins the run (`jax.distributed.initialize`, gloo collectives), runs every
scenario of `GROUP` in order and prints one JSON line per scenario:
`{"scenario": name, "process": id, "ok": bool, "error": traceback or null}`. Every
scenario checks its results on its own process; both processes must report `ok`.

Host data that a scenario needs from "the other process" is built from the process id
with a fixed formula, so each process knows what every process passed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from worker_common import NUM_PROCESSES, check, join, raises, run_scenarios

import eqxshard

# group -> scenario name -> function of the process id
SCENARIOS: dict[str, dict[str, Callable[[int], None]]] = {}


def scenario(group: str) -> Callable[[Callable[[int], None]], Callable[[int], None]]:
    def register(fn: Callable[[int], None]) -> Callable[[int], None]:
        SCENARIOS.setdefault(group, {})[fn.__name__] = fn
        return fn

    return register


# ----------------------------------------------------------------------------- helpers


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...], kind: AxisType) -> Any:
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def check_global(
    x: Any,
    mesh: Any,
    spec: P,
    expected: np.ndarray,
    what: str,
    memory_kind: str | None = None,
    gather: bool = True,
) -> None:
    """`x` is one global array on all 8 devices, laid out as `spec`, holding `expected`."""
    check(isinstance(x, jax.Array), f"{what}: got {type(x).__name__}, not a jax.Array")
    check(not x.is_fully_addressable, f"{what}: fully addressable, not a global array")
    shape = jax.random.key_data(x).shape if is_key(x) else x.shape
    check(shape == expected.shape, f"{what}: shape {shape} != {expected.shape}")
    devices = x.sharding.device_set
    check(devices == set(jax.devices()), f"{what}: on {len(devices)} devices, not all 8")
    wanted = NamedSharding(mesh, spec, memory_kind=memory_kind)
    check(
        x.sharding.is_equivalent_to(wanted, x.ndim),
        f"{what}: sharding {x.sharding} is not equivalent to {wanted}",
    )
    data = jax.random.key_data(x) if is_key(x) else x
    for shard in data.addressable_shards:
        index = shard.index + (slice(None),) * (data.ndim - len(shard.index))
        got, want = np.asarray(shard.data), expected[index]
        check(
            np.array_equal(got, want),
            f"{what}: shard on {shard.device} at {shard.index} holds {got}, expected {want}",
        )
    if not gather:
        return
    host = eqxshard.filter_get(x)
    if is_key(x):  # no NumPy form: a key array on this process holding the whole value
        check(is_key(host), f"{what}: filter_get lost the key type ({host.dtype})")
        check(host.is_fully_addressable, f"{what}: filter_get gave a global key array")
        host = np.asarray(jax.random.key_data(host))
    else:
        check(isinstance(host, np.ndarray), f"{what}: filter_get gave {type(host).__name__}")
    check(np.array_equal(host, expected), f"{what}: filter_get gave {host}, expected {expected}")


def local_batch(process: int, rows: int = 8, cols: int = 3) -> np.ndarray:
    """The local batch process `process` holds (every process can rebuild any of them)."""
    return np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + 1000.0 * process


def all_local_batches(rows: int = 8, cols: int = 3) -> np.ndarray:
    return np.concatenate([local_batch(p, rows, cols) for p in range(NUM_PROCESSES)])


def mlp() -> eqx.nn.MLP:
    # The same key on every process: identical host data.
    return eqx.nn.MLP(4, 3, 8, 2, key=jax.random.key(0))


def check_model(placed: Any, model: Any, mesh: Any, spec_of: Callable[[Any], P]) -> None:
    """Every array leaf global and right; every non-array leaf the very same object."""
    pairs = zip(
        jax.tree_util.tree_leaves_with_path(placed),
        jax.tree_util.tree_leaves(model),
        strict=True,
    )
    for (path, x), x0 in pairs:
        what = jax.tree_util.keystr(path)
        if eqx.is_array(x0):
            check_global(x, mesh, spec_of(x0), np.asarray(x0), what)
        else:
            check(x is x0, f"{what}: the static leaf {x0!r} was replaced by {x!r}")
    check(placed.activation is model.activation, "the activation was replaced")


# ----------------------------------------------------------- host data the same everywhere


@scenario("global")
def mlp_replicated(process: int) -> None:
    model = mlp()
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = make_mesh((8,), ("data",), kind)
        check_model(eqxshard.filter_shard(model, mesh), model, mesh, lambda x: P())
        check_model(eqxshard.filter_replicate(model, mesh), model, mesh, lambda x: P())


@scenario("global")
def mlp_sharded_by_callable_on_2x4(process: int) -> None:
    model = mlp()
    mesh = make_mesh((2, 4), ("data", "model"), AxisType.Explicit)

    def spec(path: Any, x: Any) -> P:
        return P("model") if x.shape[0] % 4 == 0 else P()

    placed = eqxshard.filter_shard(model, mesh, spec)
    check_model(placed, model, mesh, lambda x: spec(None, x))


@scenario("global")
def numpy_sharded_over_data(process: int) -> None:
    name = "batch"
    tree = {
        "x": np.arange(32 * 3, dtype=np.float32).reshape(32, 3),
        "y": np.arange(16, dtype=np.int32),
        "name": name,
        "n": 3,
    }
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = make_mesh((8,), ("data",), kind)
        out = eqxshard.filter_shard(tree, mesh, P("data"))
        check_global(out["x"], mesh, P("data"), tree["x"], f"{kind} ['x']")
        check_global(out["y"], mesh, P("data"), tree["y"], f"{kind} ['y']")
        check(out["name"] is name and out["n"] == 3, "statics changed")


@scenario("global")
def numpy_sharded_over_2x4(process: int) -> None:
    tree = {
        "w": np.arange(8 * 12, dtype=np.float32).reshape(8, 12),
        "b": np.arange(12, dtype=np.float32),
        "v": np.arange(6 * 4, dtype=np.int32).reshape(6, 4),
    }
    spec = {"w": P("data", "model"), "b": P("model"), "v": P("data")}
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = make_mesh((2, 4), ("data", "model"), kind)
        out = eqxshard.filter_shard(tree, mesh, spec)
        for k in tree:
            check_global(out[k], mesh, spec[k], tree[k], f"{kind} [{k!r}]")


@scenario("global")
def committed_local_arrays_to_global(process: int) -> None:
    """Committed arrays that live on this process only become one global array."""
    host = np.arange(16 * 2, dtype=np.float32).reshape(16, 2)
    local_mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("local",))
    tree = {
        "one_device": jax.device_put(host, jax.local_devices()[1]),
        "local_sharded": jax.device_put(host, NamedSharding(local_mesh, P("local"))),
        "uncommitted": jnp.asarray(host),
    }
    check(tree["one_device"].committed, "setup: not committed")
    mesh = make_mesh((8,), ("data",), AxisType.Explicit)
    out = eqxshard.filter_shard(tree, mesh, P("data"))
    for k in tree:
        check_global(out[k], mesh, P("data"), host, f"[{k!r}]")
    out = eqxshard.filter_shard(tree, mesh)
    for k in tree:
        check_global(out[k], mesh, P(), host, f"replicated [{k!r}]")


@scenario("global")
def global_arrays_resharded(process: int) -> None:
    """A global array given a new layout outside `jit`, on the same devices."""
    host = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)
    mesh = make_mesh((8,), ("data",), AxisType.Explicit)
    mesh2 = make_mesh((2, 4), ("data", "model"), AxisType.Explicit)
    x = eqxshard.filter_shard(host, mesh, P("data"))
    check(eqxshard.filter_shard(x, mesh, P("data")) is x, "an already placed leaf was copied")
    check_global(eqxshard.filter_shard(x, mesh), mesh, P(), host, "to replicated")
    check_global(eqxshard.filter_shard(x, mesh, P(None, "data")), mesh, P(None, "data"), host, "")
    check_global(
        eqxshard.filter_shard(x, mesh2, P("model", "data")), mesh2, P("model", "data"), host, "2x4"
    )
    sharding = NamedSharding(mesh2, P(None, "model"))
    check_global(eqxshard.filter_put(x, sharding), mesh2, P(None, "model"), host, "filter_put")


@scenario("global")
def memory_kinds_of_global_arrays(process: int) -> None:
    """Host data and global arrays offloaded to pinned host memory and back."""
    host = np.arange(8 * 2, dtype=np.float32).reshape(8, 2)
    mesh = make_mesh((8,), ("data",), AxisType.Explicit)
    pinned = NamedSharding(mesh, P("data"), memory_kind="pinned_host")
    # jax 0.7 on CPU cannot compile a change of memory kind of a global array ("Side-effect
    # ops cannot be replicated"), which moving a global array and gathering one from host
    # memory (`filter_get`) need: there only host data is offloaded.
    computes_on_host_memory = tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 8)
    sources = [host, eqxshard.filter_shard(host, mesh, P("data"))]
    for source in sources if computes_on_host_memory else sources[:1]:
        offloaded = eqxshard.filter_put(source, pinned)
        check_global(
            offloaded,
            mesh,
            P("data"),
            host,
            "offloaded",
            memory_kind="pinned_host",
            gather=computes_on_host_memory,
        )
        if computes_on_host_memory:
            back = eqxshard.filter_put(offloaded, memory_kind="device")
            check_global(back, mesh, P("data"), host, "back on device", memory_kind="device")


@scenario("global")
def prng_keys(process: int) -> None:
    mesh = make_mesh((8,), ("data",), AxisType.Explicit)
    tree = {"one": jax.random.key(3), "many": jax.random.split(jax.random.key(4), 8), "s": "s"}
    out = eqxshard.filter_shard(tree, mesh, {"one": P(), "many": P("data"), "s": None})
    check(out["s"] is tree["s"], "static replaced")
    for k, spec in (("one", P()), ("many", P("data"))):
        check(is_key(out[k]), f"[{k!r}] is no longer a key array: {out[k].dtype}")
        check(
            jax.random.key_impl(out[k]) == jax.random.key_impl(tree[k]),
            f"[{k!r}] changed key impl",
        )
        check_global(out[k], mesh, spec, np.asarray(jax.random.key_data(tree[k])), f"[{k!r}]")


@scenario("global")
def filter_get_whole_values(process: int) -> None:
    """`filter_get` of a tree mixing global, local and host leaves, and statics."""
    mesh = make_mesh((2, 4), ("data", "model"), AxisType.Auto)
    host = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    activation = jax.nn.relu
    tree = {
        "by_data": eqxshard.filter_shard(host, mesh, P("data")),
        "by_both": eqxshard.filter_shard(host, mesh, P("model", "data")),
        "replicated": eqxshard.filter_shard(host, mesh),
        "key": eqxshard.filter_shard(jax.random.split(jax.random.key(0), 4), mesh, P("model")),
        "local": jax.device_put(host, jax.local_devices()[2]),
        "numpy": host,
        "scalar": eqxshard.filter_shard(np.float32(2.5), mesh),
        "activation": activation,
        "size": 7,
    }
    check(not tree["by_both"].is_fully_addressable, "setup: not global")
    out = eqxshard.filter_get(tree)
    for k in ("by_data", "by_both", "replicated", "local", "numpy"):
        check(isinstance(out[k], np.ndarray), f"[{k!r}] is {type(out[k]).__name__}")
        check(np.array_equal(out[k], host), f"[{k!r}] = {out[k]}, expected {host}")
    keys = jax.random.split(jax.random.key(0), 4)
    check(is_key(out["key"]), "the key lost its type")
    check(out["key"].is_fully_addressable, "filter_get gave a key that is still global")
    check(
        np.array_equal(jax.random.key_data(out["key"]), jax.random.key_data(keys)),
        "the key's value changed",
    )
    check(
        isinstance(out["scalar"], np.ndarray) and out["scalar"] == np.float32(2.5),
        f"['scalar'] = {out['scalar']!r}",
    )
    check(out["activation"] is activation and out["size"] == 7, "statics changed")


# ------------------------------------------------------------- process-local batches


@scenario("process_local")
def process_local_numpy(process: int) -> None:
    local = local_batch(process)
    tag = "tag"
    for kind in (AxisType.Explicit, AxisType.Auto):
        for shape, names, spec in (
            ((8,), ("data",), P("data")),
            ((2, 4), ("data", "model"), P("data")),
            ((2, 4), ("data", "model"), P(("data", "model"))),
        ):
            mesh = make_mesh(shape, names, kind)
            out = eqxshard.filter_shard({"x": local, "tag": tag}, mesh, spec, process_local=True)
            check(out["tag"] is tag, "static replaced")
            check_global(out["x"], mesh, spec, all_local_batches(), f"{kind} {shape} {spec}")


@scenario("process_local")
def process_local_batch_smaller_than_mesh(process: int) -> None:
    """4 local rows per process on an 8-device axis: 8 global rows, one per device."""
    mesh = make_mesh((8,), ("data",), AxisType.Explicit)
    out = eqxshard.filter_shard(local_batch(process, rows=4), mesh, P("data"), process_local=True)
    check_global(out, mesh, P("data"), all_local_batches(rows=4), "4 rows per process")


@scenario("process_local")
def process_local_committed_arrays(process: int) -> None:
    local = local_batch(process)
    local_mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("local",))
    tree = {
        "one_device": jax.device_put(local, jax.local_devices()[3]),
        "local_sharded": jax.device_put(local, NamedSharding(local_mesh, P("local"))),
        "uncommitted": jnp.asarray(local),
    }
    mesh = make_mesh((8,), ("data",), AxisType.Explicit)
    out = eqxshard.filter_shard(tree, mesh, P("data"), process_local=True)
    for k in tree:
        check_global(out[k], mesh, P("data"), all_local_batches(), f"[{k!r}]")


@scenario("process_local")
def process_local_keys(process: int) -> None:
    keys = [jax.random.split(jax.random.key(p), 4) for p in range(NUM_PROCESSES)]
    mesh = make_mesh((8,), ("data",), AxisType.Explicit)
    out = eqxshard.filter_shard(keys[process], mesh, P("data"), process_local=True)
    check(is_key(out), f"not a key array: {out.dtype}")
    expected = np.concatenate([np.asarray(jax.random.key_data(k)) for k in keys])
    check_global(out, mesh, P("data"), expected, "keys")


@scenario("process_local")
def process_local_different_shapes_raise(process: int) -> None:
    mesh = make_mesh((8,), ("data",), AxisType.Explicit)
    tree = {
        "same": local_batch(process),
        "rows": local_batch(process, rows=8 if process == 0 else 16),
        "rank": np.zeros((8, 2) if process == 0 else (8, 2, 1), np.float32),
    }
    message = raises(
        lambda: eqxshard.filter_shard(tree, mesh, P("data"), process_local=True),
        ["process_local=True", "\n  rows", "\n  rank", "(8, 3)", "(16, 3)", "(8, 2, 1)"],
        absent=["\n  same"],
    )
    check("process 1" in message, f"the error does not say which process:\n{message}")


@scenario("process_local")
def process_local_host_data_inside_jit_raises(process: int) -> None:
    mesh = make_mesh((8,), ("data",), AxisType.Explicit)
    local = local_batch(process)

    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        return x + eqxshard.filter_shard(local, mesh, P("data"), process_local=True)

    x = eqxshard.filter_shard(all_local_batches(), mesh, P("data"))
    raises(lambda: f(x), ["process_local=True", "outside `jit`", "while `jit` traces"])


# --------------------------------------- different data where the same data is needed


@scenario("consistency")
def different_data_as_replicated_raises(process: int) -> None:
    mesh = make_mesh((8,), ("data",), AxisType.Explicit)
    tree = {
        "same": np.arange(8.0),
        "differs": np.arange(8.0) + process,
        "committed": jax.device_put(np.arange(4.0) * (process + 1), jax.local_devices()[0]),
        "static": "s",
    }
    raises(
        lambda: eqxshard.filter_shard(tree, mesh),
        ["different data on different processes", "\n  differs", "\n  committed", "[1]"],
        absent=["\n  same", "\n  static"],
    )
    raises(
        lambda: eqxshard.filter_replicate(tree, mesh),
        ["filter_replicate", "\n  differs", "\n  committed"],
        absent=["\n  same"],
    )


@scenario("consistency")
def different_data_as_sharded_raises(process: int) -> None:
    mesh = make_mesh((2, 4), ("data", "model"), AxisType.Auto)
    tree = {"w": np.ones((8, 4), np.float32), "b": np.full((8,), float(process), np.float32)}
    raises(
        lambda: eqxshard.filter_shard(tree, mesh, P("data")),
        ["different data on different processes", "\n  b", "check_consistent=False"],
        absent=["\n  w"],
    )
    sharding = NamedSharding(mesh, P("model"))
    raises(lambda: eqxshard.filter_put(tree, sharding), ["filter_put", "\n  b"])


@scenario("consistency")
def different_shapes_or_dtypes_raise(process: int) -> None:
    """Shapes and dtypes are compared (one digest) before any spec check, so no process
    raises alone (and the others wait)."""
    mesh = make_mesh((8,), ("data",), AxisType.Explicit)
    rows = 8 if process == 0 else 7  # 7 rows do not split over 8 devices: process 1 only
    tree = {"x": np.zeros((rows, 3), np.float32), "ok": np.zeros(8, np.float32)}
    raises(
        lambda: eqxshard.filter_shard(tree, mesh, P("data")),
        ["different shapes on different processes", "\n  x", "process 0: (8, 3)", "(7, 3)"],
        absent=["\n  ok", "divisible"],
    )
    dtype = np.float32 if process == 0 else np.int32  # the same bytes: zeros
    tree = {"x": np.zeros((8, 3), dtype), "ok": np.zeros(8, np.float32)}
    raises(
        lambda: eqxshard.filter_shard(tree, mesh, P("data")),
        ["different dtypes on different processes", "\n  x", "float32 (8, 3)", "int32 (8, 3)"],
        absent=["\n  ok"],
    )


@scenario("consistency")
def different_keys_raise(process: int) -> None:
    mesh = make_mesh((8,), ("data",), AxisType.Explicit)
    tree = {"key": jax.random.key(process)}
    raises(lambda: eqxshard.filter_shard(tree, mesh), ["\n  key"])


@scenario("consistency")
def check_consistent_false_skips_the_check(process: int) -> None:
    """Nothing raises; each process fills its own devices from its own data."""
    mesh = make_mesh((8,), ("data",), AxisType.Explicit)
    mine = np.arange(16, dtype=np.float32) + 100.0 * process
    out = eqxshard.filter_shard({"x": mine}, mesh, P("data"), check_consistent=False)
    # Rows 0-7 live on process 0's devices, rows 8-15 on process 1's.
    expected = np.concatenate([np.arange(8.0), np.arange(8.0, 16.0) + 100.0]).astype(np.float32)
    check_global(out["x"], mesh, P("data"), expected, "\n  x")


# ---------------------------------------------------------------- inside `jax.jit`


@scenario("jit")
def constraint_inside_jit(process: int) -> None:
    host = np.arange(16 * 2, dtype=np.float32).reshape(16, 2)
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = make_mesh((8,), ("data",), kind)
        x = eqxshard.filter_shard(host, mesh)  # replicated
        traced_specs = []

        @jax.jit
        def f(x: jax.Array, mesh: Any = mesh, traced_specs: list = traced_specs) -> jax.Array:
            y = eqxshard.filter_shard(x, mesh, P("data"))
            traced_specs.append(jax.typeof(y).sharding.spec)
            return y * 2.0

        out = f(x)
        check_global(out, mesh, P("data"), host * 2.0, f"{kind}")
        if kind == AxisType.Explicit:  # the layout is part of the traced type
            check(
                [tuple(p for p in spec if p is not None) for spec in traced_specs] == [("data",)],
                f"traced specs {traced_specs}",
            )


@scenario("jit")
def host_constant_inside_jit(process: int) -> None:
    """Host data closed over inside `jit` and placed there (a constant, then constrained)."""
    host = np.arange(16, dtype=np.float32)
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = make_mesh((8,), ("data",), kind)
        x = eqxshard.filter_shard(np.ones(16, np.float32), mesh, P("data"))

        @jax.jit
        def f(x: jax.Array, mesh: Any = mesh) -> jax.Array:
            return x + eqxshard.filter_shard(host, mesh, P("data"))

        check_global(f(x), mesh, P("data"), host + 1.0, f"{kind}")


@scenario("jit")
def training_step(process: int) -> None:
    """Replicated model, process-local batch, grad inside `jit`: the same loss everywhere."""
    from jax.experimental import multihost_utils

    model = eqx.nn.MLP(3, 2, 16, 2, key=jax.random.key(1))
    targets = [np.sin(local_batch(p))[:, :2] for p in range(NUM_PROCESSES)]

    def loss_fn(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    x_all = jnp.asarray(all_local_batches() / 1000.0)
    # The same step on this process's devices only, on the whole global batch.
    reference_loss, reference_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(
        model, x_all, jnp.asarray(np.concatenate(targets))
    )
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = make_mesh((8,), ("data",), kind)
        replicated = eqxshard.filter_shard(model, mesh)
        batch = eqxshard.filter_shard(
            (local_batch(process) / 1000.0, targets[process]), mesh, P("data"), process_local=True
        )

        @eqx.filter_jit
        def step(model: Any, batch: Any, mesh: Any = mesh) -> Any:
            x, y = eqxshard.filter_shard(batch, mesh, P("data"))
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
            return loss, eqxshard.filter_replicate(grads, mesh)

        loss, grads = step(replicated, batch)
        check(not loss.is_fully_addressable, f"{kind}: the loss is not a global array")
        value = float(eqxshard.filter_get(loss))
        everywhere = np.asarray(multihost_utils.process_allgather(np.float32(value)))
        check(everywhere[0] == everywhere[1], f"{kind}: losses differ by process: {everywhere}")
        check(
            np.isclose(value, float(reference_loss), rtol=1e-5),
            f"{kind}: loss {value} != single-process loss {float(reference_loss)}",
        )
        got = jax.tree.leaves(eqxshard.filter_get(grads))
        for g, r in zip(
            got, jax.tree.leaves(eqx.filter(reference_grads, eqx.is_array)), strict=True
        ):
            check(np.allclose(g, np.asarray(r), rtol=1e-4, atol=1e-6), f"{kind}: grads differ")


# ---------------------------------------------------------------------------- main


def main() -> None:
    process, (group,) = join(sys.argv)
    run_scenarios(SCENARIOS[group], process)


if __name__ == "__main__":
    main()
