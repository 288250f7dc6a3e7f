"""Bad inputs to the placement verbs: `filter_shard`, `filter_replicate`, `filter_put`,
`filter_get`, outside and inside `jax.jit`."""

# Every case passes a bad argument on purpose, to check the error it raises: what a type
# checker says about those arguments is the point of this file, not a mistake in it.
# pyright: reportArgumentType=false, reportCallIssue=false

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import (
    AbstractMesh,
    AxisType,
    NamedSharding,
    PartitionSpec as P,
    SingleDeviceSharding,
)

import eqxshard

from . import Case

_mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
_auto = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
_mesh4 = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
_cpu0 = jax.devices()[0]


def _w() -> dict[str, Any]:
    return {"w": jnp.ones((8, 4)), "act": jnp.tanh, "n": 3}


def _with_mesh(mesh: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        with jax.set_mesh(mesh):
            return fn()

    return call


def _jit(fn: Callable[[Any], Any], tree: Any) -> Callable[[], Any]:
    return lambda: eqx.filter_jit(fn)(tree)


def _on_mesh(x: Any) -> Any:
    return jax.device_put(x, NamedSharding(_mesh, P()))


_SHARD = "filter_shard"
_STR = np.array(["a", "b"])
_OBJ = np.array([1, "x"], dtype=object)
_DTYPE = r"dtype JAX has no arrays of:\n  bad"

CASES: list[Case] = [
    # ---- filter_shard: specs against the mesh
    Case(
        "filter_shard/indivisible",
        lambda: eqxshard.filter_shard({"w": jnp.ones((3, 4))}, _mesh, P("data")),
        ValueError,
        r"\n  w",
    ),
    Case(
        "filter_shard/indivisible-2-axes",
        lambda: eqxshard.filter_shard({"w": jnp.ones((12, 4))}, _mesh, P(("data", "model"))),
        ValueError,
        r"\n  w.*not divisible by 8",
    ),
    Case(
        "filter_shard/spec-too-long",
        lambda: eqxshard.filter_shard({"w": jnp.ones(8)}, _mesh, P("data", None)),
        ValueError,
        r"\n  w  shape \(8,\)",
    ),
    Case(
        "filter_shard/spec-on-scalar",
        lambda: eqxshard.filter_shard({"s": jnp.float32(1)}, _mesh, P("data")),
        ValueError,
        r"\n  s  shape \(\)",
    ),
    Case(
        "filter_shard/spec-on-prng-key",
        lambda: eqxshard.filter_shard({"k": jax.random.key(0)}, _mesh, P("data")),
        ValueError,
        r"\n  k  shape \(\)",
    ),
    Case(
        "filter_shard/unknown-axis",
        lambda: eqxshard.filter_shard(_w(), _mesh, P("batch")),
        ValueError,
        r"\n  w  spec P\('batch',\)",
    ),
    Case(
        "filter_shard/unknown-axis-in-tuple",
        lambda: eqxshard.filter_shard(_w(), _mesh, P(("data", "x"))),
        ValueError,
        r"\n  w.*axes \['x'\] not in mesh",
    ),
    Case(
        "filter_shard/axis-twice",
        lambda: eqxshard.filter_shard(_w(), _mesh, P("data", "data")),
        ValueError,
        r"\n  w.*used more than once",
    ),
    Case(
        "filter_shard/axis-twice-in-tuple",
        lambda: eqxshard.filter_shard(_w(), _mesh, P(("model", "model"))),
        ValueError,
        r"\n  w.*\['model'\] used more than once",
    ),
    # ---- filter_shard: wrong types of `target` / `spec`
    Case(
        "filter_shard/spec-int",
        lambda: eqxshard.filter_shard(_w(), _mesh, 3),
        TypeError,
        r"`target`/`spec`.*\n  w  spec 3",
    ),
    Case(
        "filter_shard/spec-str",
        lambda: eqxshard.filter_shard(_w(), _mesh, "data"),
        TypeError,
        r"\n  w  spec 'data' is not a PartitionSpec",
    ),
    Case(
        "filter_shard/spec-tuple-not-P",
        lambda: eqxshard.filter_shard({"w": jnp.ones(8)}, _mesh, {"w": ("data",)}),
        ValueError,
        r"`spec` whose structure is not a prefix of `tree`",
    ),
    Case(
        "filter_shard/target-int",
        lambda: eqxshard.filter_shard(_w(), 3),
        TypeError,
        r"\n  w  target 3 of type int",
    ),
    Case(
        "filter_shard/target-backend-name",
        lambda: eqxshard.filter_shard(_w(), "cpu"),
        TypeError,
        r"\n  w  target 'cpu'",
    ),
    Case(
        "filter_shard/target-device-list",
        lambda: eqxshard.filter_shard({"w": jnp.ones(8)}, jax.devices()),
        ValueError,
        r"`target`",
    ),
    Case(
        "filter_shard/partitionspec-target-and-spec",
        lambda: eqxshard.filter_shard(_w(), P("data"), P("model")),
        TypeError,
        r"\n  w  a PartitionSpec target and a `spec`",
    ),
    Case(
        "filter_shard/device-target-and-spec",
        lambda: eqxshard.filter_shard(_w(), _cpu0, P("data")),
        TypeError,
        r"\n  w  a `spec` was given with target",
    ),
    Case(
        "filter_shard/sharding-target-and-spec",
        lambda: eqxshard.filter_shard(_w(), NamedSharding(_mesh, P()), P("data")),
        TypeError,
        r"\n  w  a `spec` was given with target NamedSharding",
    ),
    Case(
        "filter_shard/rule-with-device-target",
        lambda: eqxshard.filter_shard(_w(), _cpu0, eqxshard.fsdp("data")),
        TypeError,
        r"\n  w  a rule `spec`",
    ),
    Case(
        "filter_shard/callable-spec-returns-int",
        lambda: eqxshard.filter_shard(_w(), _mesh, lambda path, x: 0),
        TypeError,
        r"\n  w  spec 0 is not a PartitionSpec",
    ),
    Case(
        "filter_shard/target-tree-not-prefix",
        lambda: eqxshard.filter_shard({"a": jnp.ones(8)}, {"b": _mesh}),
        ValueError,
        r"`target` whose structure is not a prefix of `tree`",
    ),
    Case(
        "filter_shard/spec-tree-not-prefix",
        lambda: eqxshard.filter_shard([jnp.ones(8)], _mesh, [P(), P()]),
        ValueError,
        r"`spec` whose structure is not a prefix of `tree`",
    ),
    Case(
        "filter_shard/spec-for-static-leaf",
        lambda: eqxshard.filter_shard(_w(), _mesh, {"w": P(), "act": P(), "n": None}),
        ValueError,
        r"`spec` for leaves that are not arrays:\n  act",
    ),
    Case(
        "filter_shard/process-local-not-bool",
        lambda: eqxshard.filter_shard(_w(), _mesh, process_local="yes"),
        TypeError,
        r"`process_local`",
    ),
    Case(
        "filter_shard/check-consistent-not-bool",
        lambda: eqxshard.filter_shard(_w(), _mesh, check_consistent=None),
        TypeError,
        r"`check_consistent`",
    ),
    Case(
        "filter_shard/process-local-device-target",
        lambda: eqxshard.filter_shard(_w(), _cpu0, process_local=True),
        ValueError,
        r"`process_local=True`.*\n  w  target is a SingleDeviceSharding",
    ),
    # ---- filter_shard: no mesh
    Case(
        "filter_shard/partitionspec-target-no-mesh",
        lambda: eqxshard.filter_shard(_w(), P("data")),
        ValueError,
        r"PartitionSpec but no mesh is set.*\n  w",
    ),
    Case(
        "filter_shard/spec-no-target-no-mesh",
        lambda: eqxshard.filter_shard(_w(), spec=P("data")),
        ValueError,
        r"no mesh is set.*\n  w  spec P\('data',\)",
    ),
    Case(
        "filter_shard/no-target-no-mesh",
        lambda: eqxshard.filter_shard(_w()),
        ValueError,
        r"no `target` and no mesh is set.*\n  w",
    ),
    Case(
        "filter_shard/ambient-mesh-unknown-axis",
        _with_mesh(_mesh, lambda: eqxshard.filter_shard(_w(), P("batch"))),
        ValueError,
        r"\n  w  spec P\('batch',\)",
    ),
    Case(
        "filter_shard/ambient-mesh-indivisible",
        _with_mesh(_mesh, lambda: eqxshard.filter_shard({"w": jnp.ones(6)}, spec=P("model"))),
        ValueError,
        r"\n  w  shape \(6,\)",
    ),
    # ---- filter_shard: leaves JAX has no arrays of
    Case(
        "filter_shard/str-array",
        lambda: eqxshard.filter_shard({"bad": _STR}, _mesh),
        TypeError,
        _DTYPE,
    ),
    Case(
        "filter_shard/object-array",
        lambda: eqxshard.filter_shard({"bad": _OBJ}, _mesh),
        TypeError,
        _DTYPE,
    ),
    Case(
        "filter_shard/bytes-array",
        lambda: eqxshard.filter_shard({"bad": np.array([b"ab"])}, _mesh),
        TypeError,
        _DTYPE,
    ),
    Case(
        "filter_shard/datetime-array",
        lambda: eqxshard.filter_shard({"bad": np.array(["2024-01-01"], "datetime64[D]")}, _mesh),
        TypeError,
        _DTYPE,
    ),
    Case(
        "filter_shard/timedelta-array",
        lambda: eqxshard.filter_shard({"bad": np.array([1], "timedelta64[s]")}, _cpu0),
        TypeError,
        _DTYPE,
    ),
    Case(
        "filter_shard/structured-array",
        lambda: eqxshard.filter_shard({"bad": np.zeros(2, [("a", "f4")])}, _mesh),
        TypeError,
        _DTYPE,
    ),
    Case(
        "filter_shard/numpy-str-scalar",
        lambda: eqxshard.filter_shard({"bad": np.str_("x")}, NamedSharding(_mesh, P())),
        TypeError,
        _DTYPE,
    ),
    # ---- filter_shard inside `jit`
    Case(
        "jit/filter_shard/indivisible",
        _jit(lambda t: eqxshard.filter_shard(t, _mesh, P("model")), {"w": jnp.ones(6)}),
        ValueError,
        r"\n  w  shape \(6,\)",
    ),
    Case(
        "jit/filter_shard/unknown-axis",
        _jit(lambda t: eqxshard.filter_shard(t, _auto, P("x")), {"w": jnp.ones(8)}),
        ValueError,
        r"\n  w  spec P\('x',\)",
    ),
    Case(
        "jit/filter_shard/no-target-no-mesh",
        _jit(eqxshard.filter_shard, {"w": jnp.ones(8)}),
        ValueError,
        r"no `target` and no mesh is set.*\n  w",
    ),
    Case(
        "jit/filter_shard/other-device-set",
        _jit(lambda t: eqxshard.filter_shard(t, _mesh4, P("data")), {"w": _on_mesh(jnp.ones(8))}),
        ValueError,
        r"another device set inside `jit`:\n  w",
    ),
    Case(
        "jit/filter_shard/process-local",
        _jit(
            lambda t: eqxshard.filter_shard(t, _mesh, P(), process_local=True), {"w": jnp.ones(8)}
        ),
        ValueError,
        r"`process_local=True`.*\n  w  is traced",
    ),
    Case(
        "jit/filter_shard/host-str-array-constant",
        lambda: jax.jit(lambda x: x + len(eqxshard.filter_shard({"bad": _STR}, _mesh)))(1.0),
        TypeError,
        _DTYPE,
    ),
    # ---- filter_replicate
    Case(
        "filter_replicate/mesh-is-device",
        lambda: eqxshard.filter_replicate(_w(), _cpu0),  # type: ignore[arg-type]
        TypeError,
        r"`mesh`",
    ),
    Case(
        "filter_replicate/mesh-is-partitionspec",
        lambda: eqxshard.filter_replicate(_w(), P("data")),  # type: ignore[arg-type]
        TypeError,
        r"`mesh`",
    ),
    Case(
        "filter_replicate/mesh-is-sharding",
        lambda: eqxshard.filter_replicate(_w(), NamedSharding(_mesh, P())),  # type: ignore[arg-type]
        TypeError,
        r"`mesh`",
    ),
    Case(
        "filter_replicate/mesh-is-str",
        lambda: eqxshard.filter_replicate(_w(), "data"),  # type: ignore[arg-type]
        TypeError,
        r"`mesh`",
    ),
    Case(
        "filter_replicate/no-mesh",
        lambda: eqxshard.filter_replicate(_w()),
        ValueError,
        r"no `mesh` and no mesh is set.*\n  w",
    ),
    Case(
        "filter_replicate/str-array",
        lambda: eqxshard.filter_replicate({"w": jnp.ones(8), "bad": _STR}, _mesh),
        TypeError,
        _DTYPE,
    ),
    Case(
        "jit/filter_replicate/no-mesh",
        _jit(eqxshard.filter_replicate, {"w": jnp.ones(8)}),
        ValueError,
        r"no `mesh` and no mesh is set.*\n  w",
    ),
    Case(
        "jit/filter_replicate/other-device-set",
        _jit(lambda t: eqxshard.filter_replicate(t, _mesh4), {"w": _on_mesh(jnp.ones(8))}),
        ValueError,
        r"\n  w  lives on 8",
    ),
    # ---- filter_put
    Case(
        "filter_put/no-target-no-memory-kind",
        lambda: eqxshard.filter_put(_w()),
        TypeError,
        r"`target`.*`memory_kind`",
    ),
    Case(
        "filter_put/memory-kind-int",
        lambda: eqxshard.filter_put(_w(), memory_kind=1),  # type: ignore[arg-type]
        TypeError,
        r"`memory_kind`",
    ),
    Case(
        "filter_put/memory-kind-unknown",
        lambda: eqxshard.filter_put(_w(), memory_kind="hbm"),
        ValueError,
        r"memory_kind='hbm'.*\n  w",
    ),
    Case(
        "filter_put/memory-kind-empty",
        lambda: eqxshard.filter_put(_w(), _cpu0, memory_kind=""),
        ValueError,
        r"memory_kind=''.*\n  w",
    ),
    Case(
        "filter_put/memory-kind-wrong-case",
        lambda: eqxshard.filter_put(_w(), _mesh, memory_kind="Pinned_Host"),
        ValueError,
        r"memory_kind='Pinned_Host'.*\n  w",
    ),
    Case(
        "filter_put/unknown-backend",
        lambda: eqxshard.filter_put(_w(), "tpu"),
        ValueError,
        r"`target`.*'tpu'",
    ),
    Case(
        "filter_put/backend-name-typo",
        lambda: eqxshard.filter_put(_w(), "CPU "),
        ValueError,
        r"`target`.*'CPU '",
    ),
    Case(
        "filter_put/target-int",
        lambda: eqxshard.filter_put(_w(), 0),
        TypeError,
        r"\n  w  target 0 of type int",
    ),
    Case(
        "filter_put/target-float",
        lambda: eqxshard.filter_put(_w(), 1.5),
        TypeError,
        r"\n  w  target 1.5 of type float",
    ),
    Case(
        "filter_put/partitionspec-no-mesh",
        lambda: eqxshard.filter_put(_w(), P("data")),
        ValueError,
        r"no mesh is set.*\n  w",
    ),
    Case(
        "filter_put/target-tree-not-prefix",
        lambda: eqxshard.filter_put([jnp.ones(2)], [_cpu0, _cpu0]),
        ValueError,
        r"`target` whose structure is not a prefix of `tree`",
    ),
    Case(
        "filter_put/str-array-to-device",
        lambda: eqxshard.filter_put({"bad": _STR}, _cpu0),
        TypeError,
        _DTYPE,
    ),
    Case(
        "filter_put/object-array-memory-kind",
        lambda: eqxshard.filter_put({"bad": _OBJ}, memory_kind="pinned_host"),
        TypeError,
        _DTYPE,
    ),
    Case(
        "filter_put/str-array-to-backend",
        lambda: eqxshard.filter_put({"bad": _STR}, "cpu"),
        TypeError,
        _DTYPE,
    ),
    Case(
        "jit/filter_put/to-device",
        _jit(lambda t: eqxshard.filter_put(t, _cpu0), {"w": jnp.ones(8)}),
        ValueError,
        r"traced leaves to a device inside `jit`:\n  w",
    ),
    Case(
        "jit/filter_put/to-single-device-sharding",
        _jit(lambda t: eqxshard.filter_put(t, SingleDeviceSharding(_cpu0)), {"w": jnp.ones(8)}),
        ValueError,
        r"\n  w  asked for SingleDeviceSharding",
    ),
    Case(
        "jit/filter_put/unknown-memory-kind",
        _jit(lambda t: eqxshard.filter_put(t, memory_kind="hbm"), {"w": jnp.ones(8)}),
        ValueError,
        r"memory_kind='hbm'.*\n  w",
    ),
    # ---- filter_get: inside transformations there is no value to fetch
    Case(
        "jit/filter_get",
        _jit(eqxshard.filter_get, {"w": jnp.ones(8)}),
        TypeError,
        r"cannot fetch traced leaves.*\n  w",
    ),
    Case(
        "vmap/filter_get",
        lambda: jax.vmap(lambda x: eqxshard.filter_get({"row": x}))(jnp.ones((2, 3))),
        TypeError,
        r"\n  row",
    ),
    Case(
        "grad/filter_get",
        lambda: jax.grad(lambda x: eqxshard.filter_get({"x": x})["x"])(1.0),
        TypeError,
        r"\n  x",
    ),
    Case(
        "eval_shape/filter_get",
        lambda: jax.eval_shape(lambda x: eqxshard.filter_get([x]), jnp.ones(3)),
        TypeError,
        r"\n  0",
    ),
    # ---- an AbstractMesh outside `jit`: no devices to place on (was JAX's "must be a
    # `NamedSharding`" TypeError, naming no leaf)
    Case(
        "filter_shard/abstract-mesh-eager",
        lambda: eqxshard.filter_shard(_w(), AbstractMesh((2, 4), ("data", "model")), P("data")),
        ValueError,
        r"on an AbstractMesh outside `jit`: it has no devices.\n  w",
    ),
    Case(
        "filter_replicate/abstract-mesh-eager",
        lambda: eqxshard.filter_replicate(jnp.ones(8), AbstractMesh((8,), ("data",))),
        ValueError,
        r"`filter_replicate` cannot place these leaves on an AbstractMesh.*\n  <root>",
    ),
    Case(
        "filter_put/abstract-mesh-eager",
        lambda: eqxshard.filter_put(
            {"x": jnp.ones(8)}, NamedSharding(AbstractMesh((8,), ("data",)), P("data"))
        ),
        ValueError,
        r"(?s)`filter_put` cannot place .*AbstractMesh.*\n  x.*concrete `jax.sharding.Mesh`",
    ),
    # ---- inside `jit`, an AbstractMesh of the set mesh's axes but other axis types (was
    # JAX's bare AssertionError from `with_sharding_constraint`)
    Case(
        "filter_shard/abstract-mesh-other-axis-types-in-jit",
        lambda: _in_jit_under_explicit(
            lambda x: eqxshard.filter_shard({"x": x}, _auto_abstract(), P("data"))
        ),
        ValueError,
        r"(?s)AbstractMesh whose axes are those of the mesh set.*\(data: Explicit\).*"
        r"\n  x  axis types \(data: Auto\)",
    ),
]


def _auto_abstract() -> AbstractMesh:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    return mesh.abstract_mesh


def _in_jit_under_explicit(fn: Callable[[Any], Any]) -> Any:
    explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(explicit):
        return jax.jit(fn)(jnp.ones(8))
