"""Bad inputs to `filter_shard_map`: its arguments, its specs and the call itself."""

# Every case passes a bad argument on purpose, to check the error it raises: what a type
# checker says about those arguments is the point of this file, not a mistake in it.
# pyright: reportArgumentType=false, reportCallIssue=false

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from eqxshard import filter_shard_map

from . import Case

_mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
_other = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
_args = ({"w": jnp.ones((4, 8)), "act": jax.nn.relu},)


def _run(fun=lambda t: t["w"], *, args=_args, call_kwargs=None, **kwargs):
    def call():
        options: dict[str, Any] = dict(mesh=_mesh, in_specs=P("x"), out_specs=P("x"))
        options.update(kwargs)
        return filter_shard_map(fun, **options)(*args, **(call_kwargs or {}))

    return call


def _no_mesh():
    return filter_shard_map(lambda x: x, in_specs=P(), out_specs=P())(jnp.ones(8))


CASES: list[Case] = [
    Case(
        "filter_shard_map/fun-not-callable",
        lambda: filter_shard_map(3, mesh=_mesh, in_specs=P(), out_specs=P()),
        TypeError,
        r"callable `fun`",
    ),
    Case(
        "filter_shard_map/mesh-not-a-mesh",
        _run(mesh=(2, 4)),
        TypeError,
        r"`filter_shard_map\(mesh=\.\.\.\)`",
    ),
    Case("filter_shard_map/no-mesh", _no_mesh, ValueError, r"without a `mesh`"),
    Case(
        "filter_shard_map/axis-names-a-string",
        _run(axis_names="x"),
        TypeError,
        r"`filter_shard_map\(axis_names=\.\.\.\)`",
    ),
    Case(
        "filter_shard_map/axis-names-not-in-mesh",
        _run(axis_names={"x", "batch"}),
        ValueError,
        r"`filter_shard_map\(axis_names=\.\.\.\)` names axes \['batch'\]",
    ),
    Case(
        "filter_shard_map/in-specs-not-a-prefix",
        _run(in_specs=(P("x"), P("y"))),
        ValueError,
        r"`in_specs`",
    ),
    Case(
        "filter_shard_map/in-specs-not-a-spec",
        _run(in_specs=({"w": "x", "act": None},)),
        TypeError,
        r"(?s)`in_specs`.*\n  0\.w",
    ),
    Case(
        "filter_shard_map/in-specs-on-a-static",
        _run(in_specs=({"w": P("x"), "act": P()},)),
        ValueError,
        r"\n  0\.act",
    ),
    Case(
        "filter_shard_map/in-specs-axis-not-in-mesh",
        _run(in_specs=P("batch")),
        ValueError,
        r"(?s)axes its mesh does not have.*\n  0\.w",
    ),
    Case(
        "filter_shard_map/in-specs-axis-twice",
        _run(in_specs=P("x", "x")),
        ValueError,
        r"(?s)more than once.*\n  0\.w",
    ),
    Case(
        "filter_shard_map/in-specs-indivisible",
        _run(args=({"w": jnp.ones((3, 8)), "act": jax.nn.relu},)),
        ValueError,
        r"(?s)evenly.*\n  0\.w.*dim 0 = 3",
    ),
    Case(
        "filter_shard_map/in-specs-outside-axis-names",
        _run(in_specs=P("y"), axis_names={"x"}),
        ValueError,
        r"(?s)`in_specs` naming mesh axes outside `axis_names`.*\n  0\.w",
    ),
    Case(
        "filter_shard_map/in-specs-named-sharding-other-mesh",
        _run(in_specs=NamedSharding(_other, P("x"))),
        ValueError,
        r"(?s)`in_specs` NamedShardings on another mesh.*\n  0\.w",
    ),
    Case(
        "filter_shard_map/out-specs-none-for-an-array",
        _run(fun=lambda t: {"out": t["w"]}, out_specs=None),
        ValueError,
        r"(?s)`None` in `out_specs`.*\n  out",
    ),
    Case(
        "filter_shard_map/out-specs-axis-not-in-mesh",
        _run(fun=lambda t: {"out": t["w"]}, out_specs={"out": P("batch")}),
        ValueError,
        r"(?s)`out_specs`.*\n  out.*\['batch'\]",
    ),
    Case(
        "filter_shard_map/out-specs-too-many-entries",
        _run(fun=lambda t: {"out": t["w"].sum()}, out_specs={"out": P("x")}),
        ValueError,
        r"(?s)`out_specs`.*\n  out.*1 entries",
    ),
    Case(
        "filter_shard_map/keyword-arguments",
        _run(args=(), call_kwargs={"t": _args[0]}),
        TypeError,
        r"keyword arguments \['t'\].*`in_specs`",
    ),
    Case(
        "filter_shard_map/numpy-strings",
        _run(args=({"w": jnp.ones((4, 8)), "names": np.array(["a", "b", "c", "d"])},)),
        TypeError,
        r"(?s)`filter_shard_map` got array leaves whose dtype JAX has no arrays of:"
        r"\n  0\.names  dtype <U1  \(strings\).*by closure",
    ),
]
