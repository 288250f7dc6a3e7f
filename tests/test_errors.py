"""Every error eqxshard raises: its type, its key words, every failing leaf by path, a fix.

Each case also checks that nothing was placed: the error comes from the checks that run
over all leaves before any `jax.device_put`, so a bad leaf among good ones moves nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MESH_KINDS, make_mesh, mesh_on
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxshard
from eqxshard import _compat


@pytest.fixture
def device_puts(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Records every `jax.device_put` and process-local array build eqxshard makes."""
    calls: list[Any] = []
    device_put = jax.device_put
    from_local = jax.make_array_from_process_local_data

    def recording_put(*args: Any, **kwargs: Any) -> Any:
        calls.append(("device_put", args, kwargs))
        return device_put(*args, **kwargs)

    def recording_local(*args: Any, **kwargs: Any) -> Any:
        calls.append(("make_array_from_process_local_data", args, kwargs))
        return from_local(*args, **kwargs)

    monkeypatch.setattr(jax, "device_put", recording_put)
    monkeypatch.setattr(jax, "make_array_from_process_local_data", recording_local)
    return calls


def test_the_recorder_sees_placement(device_puts: list[Any]) -> None:
    """The `device_puts` fixture does see eqxshard's transfers (so `== []` below means it)."""
    eqxshard.filter_shard({"x": np.ones(8)}, make_mesh("explicit"), P("data"))
    assert [name for name, *_ in device_puts] == ["device_put"]


def _tree() -> dict[str, Any]:
    """Two leaves that every case below makes bad, one good leaf, and non-array leaves."""
    return {
        "good": jnp.arange(32.0).reshape(8, 4),
        "bad1": jnp.ones((6, 4)),
        "bad2": np.ones((8, 3), np.float32),
        "fn": jnp.tanh,
        "n": 3,
    }


@dataclass
class Case:
    """A call that must raise `exc` matching `match`, naming `paths`, saying `fix`."""

    call: Callable[[], Any]
    exc: type[Exception]
    match: str
    paths: Sequence[str] = ()
    fix: str = ""


def _jit(fun: Callable[[Any], Any], tree: Any) -> Callable[[], Any]:
    return lambda: eqx.filter_jit(fun)(tree)


def _cases(kind: str) -> dict[str, Case]:
    mesh = make_mesh(kind)
    mesh4 = mesh_on(kind, jax.devices()[:4])
    tree = _tree()
    both = ("\n  bad1", "\n  bad2")
    on_mesh = {
        "good": jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("data"))),
        "bad1": jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, P("data", "model"))),
        "bad2": jax.device_put(jnp.ones((8,)), NamedSharding(mesh, P())),
    }
    good_none = {"good": P("data"), "fn": None, "n": None}

    return {
        "spec rank": Case(
            lambda: eqxshard.filter_shard(
                tree,
                mesh,
                {**good_none, "bad1": P(None, None, "data"), "bad2": P("data", None, None)},
            ),
            ValueError,
            "more entries than their leaves have dims",
            both,
            "at most one entry per dim",
        ),
        "unknown mesh axis": Case(
            lambda: eqxshard.filter_shard(
                tree, mesh, {**good_none, "bad1": P("batch"), "bad2": P(None, ("model", "x"))}
            ),
            ValueError,
            "axes its mesh does not have",
            (*both, "['batch']", "['x']", "['data', 'model']"),
            "Use only the mesh's axis names",
        ),
        "mesh axis used twice": Case(
            lambda: eqxshard.filter_shard(
                tree, mesh, {**good_none, "bad1": P("data", "data"), "bad2": P(("model", "model"))}
            ),
            ValueError,
            "use a mesh axis more than once",
            (*both, "['data'] used more than once", "['model'] used more than once"),
            "use each name once per spec",
        ),
        "indivisible dims": Case(
            lambda: eqxshard.filter_shard(
                tree, mesh, {**good_none, "bad1": P("data"), "bad2": P(None, "model")}
            ),
            ValueError,
            "cannot split these leaves evenly",
            (
                *both,
                "shape (6, 4)",
                "dim 0 = 6 is not divisible by 4",
                "shape (8, 3)",
                "dim 1 = 3 is not divisible by 2",
            ),
            "Pad these dims",
        ),
        "indivisible dims, NamedSharding target": Case(
            lambda: eqxshard.filter_shard(
                {"bad1": tree["bad1"], "bad2": np.ones(12, np.float32)},
                NamedSharding(mesh, P(("data", "model"))),
            ),
            ValueError,
            "cannot split these leaves evenly",
            (*both, "is not divisible by 8", "'data' x 'model'"),
            "Pad these dims",
        ),
        "target prefix does not match": Case(
            lambda: eqxshard.filter_shard(tree, {"good": mesh, "other": mesh}),
            ValueError,
            "got a `target` whose structure is not a prefix of `tree`",
            ("other",),
            "Give `target` the structure of `tree`",
        ),
        "spec prefix does not match": Case(
            lambda: eqxshard.filter_shard(tree, mesh, [P("data"), P()]),
            ValueError,
            "got a `spec` whose structure is not a prefix of `tree`",
            ("list",),
            "Give `spec` the structure of `tree`",
        ),
        "PartitionSpec without a mesh": Case(
            lambda: eqxshard.filter_shard(tree, P("data")),
            ValueError,
            "was given a PartitionSpec but no mesh is set",
            (*both, "\n  good"),
            "jax.set_mesh",
        ),
        "spec without target or mesh": Case(
            lambda: eqxshard.filter_shard(tree, spec=P("data")),
            ValueError,
            "no mesh is set",
            both,
            "Pass a mesh",
        ),
        "filter_replicate without a mesh": Case(
            lambda: eqxshard.filter_replicate(tree),
            ValueError,
            "`filter_replicate` was given no `mesh` and no mesh is set",
            both,
            "Pass `mesh` (a `Mesh`), or set a mesh with `jax.set_mesh(mesh)`",
        ),
        "no target and no mesh": Case(
            lambda: eqxshard.filter_shard(tree),
            ValueError,
            "`filter_shard` was given no `target` and no mesh is set",
            (*both, "\n  good"),
            "Pass `target` (a mesh, a sharding or a device)",
        ),
        "jit: no target and no mesh": Case(
            _jit(eqxshard.filter_shard, tree),
            ValueError,
            "`filter_shard` was given no `target` and no mesh is set",
            (*both, "\n  good"),
            "jax.set_mesh(mesh)",
        ),
        "string and object arrays": Case(
            lambda: eqxshard.filter_shard(
                {**tree, "s": np.array(["a", "b"]), "o": np.array([1, "x"], dtype=object)}, mesh
            ),
            TypeError,
            "`filter_shard` got array leaves whose dtype JAX has no arrays of",
            ("\n  s  dtype <U1", "(strings)", "\n  o  dtype object  (Python objects)"),
            "`eqx.field(static=True)`",
        ),
        "filter_put: string arrays": Case(
            lambda: eqxshard.filter_put({**tree, "s": np.str_("abc")}, memory_kind="device"),
            TypeError,
            "`filter_put` got array leaves whose dtype JAX has no arrays of",
            ("\n  s  dtype <U3",),
            "numeric dtype",
        ),
        "spec for non-array leaves": Case(
            lambda: eqxshard.filter_shard(
                tree, mesh, {"good": P(), "bad1": None, "bad2": None, "fn": P(), "n": P()}
            ),
            ValueError,
            "got a `spec` for leaves that are not arrays",
            ("\n  fn", "\n  n", "int"),
            "put `None` at these paths in `spec`",
        ),
        "target of a wrong type": Case(
            lambda: eqxshard.filter_shard(
                tree, {"good": mesh, "bad1": 3, "bad2": "data", "fn": None, "n": None}
            ),
            TypeError,
            "cannot read the `target`/`spec`",
            (*both, "target 3 of type int", "target 'data' of type str"),
            "A target is a Mesh, a Sharding, a Device or a PartitionSpec",
        ),
        "spec with a Device target": Case(
            lambda: eqxshard.filter_shard(tree, jax.devices()[0], P("data")),
            TypeError,
            "which fixes the layout",
            (*both, "\n  good"),
            "goes only with a Mesh target",
        ),
        "PartitionSpec target and a spec": Case(
            lambda: eqxshard.filter_shard(tree, P("data"), P("data")),
            TypeError,
            "a PartitionSpec target and a `spec` were both given",
            both,
            "A target is",
        ),
        "spec that is not a PartitionSpec": Case(
            lambda: eqxshard.filter_shard(
                tree, mesh, lambda path, leaf: None if leaf.shape == (8, 4) else ("data",)
            ),
            TypeError,
            r"spec \('data',\) is not a PartitionSpec",
            both,
            "a `spec` is a PartitionSpec",
        ),
        "rule spec with a Device target": Case(
            lambda: eqxshard.filter_shard(tree, jax.devices()[0], _ReplicateRule()),
            TypeError,
            "a rule `spec` was given with target",
            both,
            "goes only with a Mesh target",
        ),
        "filter_replicate on a device": Case(
            lambda: eqxshard.filter_replicate(tree, jax.devices()[0]),  # pyright: ignore
            TypeError,
            "`filter_replicate` takes a `Mesh` as `mesh`, but got",
            (),
            "use `filter_shard(tree, target)`",
        ),
        "filter_replicate on a sharding": Case(
            lambda: eqxshard.filter_replicate(tree, NamedSharding(mesh, P())),  # pyright: ignore
            TypeError,
            "but got NamedSharding",
            (),
            "use `filter_shard",
        ),
        "jit: move to a mesh over other devices": Case(
            _jit(
                lambda t: eqxshard.filter_shard(
                    t, {"good": None, "bad1": mesh4, "bad2": mesh4}, P()
                ),
                on_mesh,
            ),
            ValueError,
            "cannot move these traced leaves to another device set inside `jit`",
            (*both, "lives on 8", "asked for 4"),
            "Move the data outside `jit` first",
        ),
        "jit: move to a single device": Case(
            _jit(
                lambda t: eqxshard.filter_shard(
                    t, {"good": None, "bad1": jax.devices()[0], "bad2": jax.devices()[1]}
                ),
                on_mesh,
            ),
            ValueError,
            "cannot move these traced leaves to another device set inside `jit`",
            (*both, "asked for 1"),
            "`eqxshard.filter_put` or `eqxshard.filter_shard`",
        ),
        "jit: filter_replicate on another mesh": Case(
            _jit(lambda t: eqxshard.filter_replicate(t, mesh4), on_mesh),
            ValueError,
            "`filter_replicate` cannot move these traced leaves",
            (*both, "\n  good"),
            "Move the data outside `jit`",
        ),
        "jit: filter_put to a mesh over other devices": Case(
            _jit(
                lambda t: eqxshard.filter_put(t, {"good": None, "bad1": mesh4, "bad2": mesh4}),
                on_mesh,
            ),
            ValueError,
            "`filter_put` cannot move these traced leaves to another device set inside `jit`",
            (*both, "asked for 4"),
            "Move the data outside `jit`",
        ),
        "jit: filter_put to a device": Case(
            _jit(
                lambda t: eqxshard.filter_put(
                    t, {"good": None, "bad1": jax.devices()[0], "bad2": "cpu"}
                ),
                on_mesh,
            ),
            ValueError,
            "`filter_put` cannot move these traced leaves to a device inside `jit`",
            (*both, "SingleDeviceSharding"),
            "Call `filter_put` outside `jit`",
        ),
        "process_local with a Device target": Case(
            lambda: eqxshard.filter_shard(tree, jax.devices()[0], process_local=True),
            ValueError,
            r"`process_local=True` needs a mesh target",
            (*both, "target is a SingleDeviceSharding"),
            "Call it outside `jit` with `target=mesh`",
        ),
        "process_local inside jit": Case(
            _jit(lambda t: eqxshard.filter_shard(t, mesh, P("data"), process_local=True), on_mesh),
            ValueError,
            r"`process_local=True` needs .* concrete data, outside `jit`",
            (*both, "is traced (inside `jit`)"),
            "Call it outside `jit`",
        ),
        "filter_put with neither target nor memory kind": Case(
            lambda: eqxshard.filter_put(tree),
            TypeError,
            "needs a `target` .* or a `memory_kind`; it was given neither",
        ),
        "filter_put with a memory kind that is not a string": Case(
            lambda: eqxshard.filter_put(tree, memory_kind=1),  # pyright: ignore
            TypeError,
            "takes `memory_kind` as a string",
            ("got 1 of type int",),
            "'pinned_host'",
        ),
        "filter_put to an unknown backend": Case(
            lambda: eqxshard.filter_put(tree, "not_a_backend"),
            ValueError,
            "got `target`='not_a_backend', a backend this process does not have",
            (repr(jax.devices()[0].platform),),
            "Pass one of them, a `jax.Device` or a `Sharding`",
        ),
        "filter_put to a memory kind the devices lack": Case(
            lambda: eqxshard.filter_put(tree, memory_kind="hbm"),
            ValueError,
            "got memory_kind='hbm', which these leaves' target devices do not have",
            (*both, "\n  good", "'device'"),
            "Pass one of the memory kinds listed",
        ),
        "jit: filter_put to a memory kind JAX cannot name": Case(
            _jit(lambda t: eqxshard.filter_put(t, memory_kind="hbm"), on_mesh),
            ValueError,
            "got memory_kind='hbm'",
            (*both, "'pinned_host'"),
            "Pass one of the memory kinds listed",
        ),
        "jit: filter_get": Case(
            _jit(eqxshard.filter_get, on_mesh),
            TypeError,
            "`filter_get` cannot fetch traced leaves",
            (*both, "\n  good"),
            "Call `filter_get` outside the transformation",
        ),
    }


class _ReplicateRule:
    def spec_for(self, path: Any, leaf: Any, mesh: Any) -> P:
        return P()


CASE_NAMES = list(_cases("auto"))


@pytest.mark.parametrize("kind", MESH_KINDS)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_error(name: str, kind: str, device_puts: list[Any]) -> None:
    case = _cases(kind)[name]
    device_puts.clear()  # building the inputs above puts arrays on devices
    with pytest.raises(case.exc, match=case.match) as info:
        case.call()
    message = str(info.value)
    for path in case.paths:
        assert path in message, f"{path!r} not in:\n{message}"
    assert case.fix in message
    assert device_puts == [], "an error must be raised before anything is placed"


class _Net(eqx.Module):
    layers: list[eqx.nn.Linear]
    scale: jax.Array
    act: Callable[[Any], Any]


def _net() -> _Net:
    k1, k2 = jax.random.split(jax.random.key(0))
    layers = [eqx.nn.Linear(8, 4, key=k1), eqx.nn.Linear(4, 6, key=k2)]
    return _Net(layers, jnp.ones((4, 3)), jax.nn.relu)


def test_leaf_error_is_a_table_of_every_bad_leaf() -> None:
    """Header, one aligned row per bad leaf (dotted paths, as `path_rules` match), then the fix."""
    with pytest.raises(ValueError) as info:
        eqxshard.filter_shard(_net(), make_mesh("explicit"), P(None, "data"))
    lines = str(info.value).splitlines()
    assert lines[0] == "`filter_shard` got specs with more entries than their leaves have dims:"
    rows = lines[1:-1]
    assert [row.split()[0] for row in rows] == ["layers.0.bias", "layers.1.bias"]
    assert all(row.startswith("  ") for row in rows)
    assert len({row.index("shape") for row in rows}) == 1  # aligned columns
    assert "shape (4,)  spec" in rows[0] and "has 2 entries" in rows[0]
    assert lines[-1].startswith("Give each leaf a spec with at most one entry per dim")


def test_every_bad_leaf_of_a_model_is_named() -> None:
    """Only the leaves that fail are listed, each with its shape and the failing dim."""
    net = _net()
    with pytest.raises(ValueError, match="cannot split these leaves evenly") as info:
        eqxshard.filter_shard(
            net,
            make_mesh("auto"),
            lambda path, leaf: P("data", "model") if leaf.ndim == 2 else None,
        )
    rows = str(info.value).splitlines()[1:-1]
    assert [row.split()[0] for row in rows] == ["layers.1.weight", "scale"]
    assert "shape (6, 4)" in rows[0] and "dim 0 = 6 is not divisible by 4" in rows[0]
    assert "shape (4, 3)" in rows[1] and "dim 1 = 3 is not divisible by 2" in rows[1]


def test_vmap_and_grad_leaves_are_traced_for_filter_get() -> None:
    """Tracing is decided per leaf, so `vmap`/`grad` without `jit` are caught too."""
    with pytest.raises(TypeError, match="cannot fetch traced leaves"):
        jax.vmap(lambda x: eqxshard.filter_get({"x": x})["x"])(jnp.ones(3))
    with pytest.raises(TypeError, match=re.escape("\n  x")):
        jax.grad(lambda x: eqxshard.filter_get({"x": x})["x"])(1.0)


def test_memory_kind_inside_jit_where_jax_cannot(device_puts: list[Any]) -> None:
    """Where JAX would drop or reject a memory move inside `jit`, eqxshard says so first."""
    mesh = make_mesh("auto")
    x = {"w": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))}
    device_puts.clear()
    offload = eqx.filter_jit(lambda t: eqxshard.filter_put(t, memory_kind="pinned_host"))
    if _compat.memory_kinds_in_jit():
        out = offload(x)
        assert out["w"].sharding.memory_kind == "pinned_host"
    else:
        with pytest.raises(ValueError, match="cannot change memory kinds inside `jit`") as info:
            offload(x)
        assert "\n  w" in str(info.value)
        assert "Call `filter_put` outside `jit`" in str(info.value)
        assert device_puts == []


_NO_TARGET_CALLS = {
    "filter_shard": lambda tree: eqxshard.filter_shard(tree),
    "filter_replicate": lambda tree: eqxshard.filter_replicate(tree),
    "filter_shardings": lambda tree: eqxshard.filter_shardings(tree),
    "filter_init": lambda tree: eqxshard.filter_init(lambda: tree)(),
    "jit: filter_shard": lambda tree: jax.jit(eqxshard.filter_shard)(tree),
    "jit: filter_replicate": lambda tree: jax.jit(eqxshard.filter_replicate)(tree),
}


@pytest.mark.parametrize("name", list(_NO_TARGET_CALLS))
def test_no_target_and_no_mesh_says_so(name: str) -> None:
    """Not "was given a PartitionSpec" (none was given), and no internal sentinel object."""
    with pytest.raises(ValueError, match="no `(target|mesh)` and no mesh is set") as info:
        _NO_TARGET_CALLS[name]({"w": jnp.ones((4, 2)), "b": jnp.zeros(2)})
    message = str(info.value)
    assert "\n  w" in message and "\n  b" in message
    assert "object at" not in message and "PartitionSpec" not in message, message


@pytest.mark.parametrize(
    ("value", "word"),
    [
        (np.array(["a", "b"]), "strings"),
        (np.array([b"a"]), "bytes"),
        (np.array([1, "a"], dtype=object), "Python objects"),
        (np.array(["2020-01-01"], dtype="datetime64[D]"), "datetimes"),
        (np.array([3], dtype="timedelta64[s]"), "timedeltas"),
        (np.zeros(2, dtype=[("a", "f4")]), "structured"),
        (np.str_("x"), "strings"),
    ],
)
def test_non_jax_dtypes_are_named_before_jax_runs(value: Any, word: str) -> None:
    mesh = make_mesh("explicit")
    tree = {"ok": np.ones(8, np.float32), "bad": [value]}
    for call in (
        lambda: eqxshard.filter_shard(tree, mesh),
        lambda: eqxshard.filter_replicate(tree, mesh),
        lambda: eqxshard.filter_put(tree, jax.devices()[0]),
        lambda: eqxshard.filter_shardings(tree, mesh),
    ):
        with pytest.raises(TypeError, match="dtype JAX has no arrays of") as info:
            call()
        message = str(info.value)
        assert "\n  bad.0" in message and word in message and "\n  ok" not in message


def test_non_jax_dtypes_left_alone_are_fine() -> None:
    mesh = make_mesh("explicit")
    tree = {"ok": np.ones(8, np.float32), "names": np.array(["a", "b"])}
    out = eqxshard.filter_shard(tree, {"ok": mesh, "names": None})
    assert out["names"] is tree["names"]
    assert out["ok"].sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)
    got = eqxshard.filter_get(tree)
    assert got["names"] is tree["names"] or np.array_equal(got["names"], tree["names"])
