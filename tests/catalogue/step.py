"""Bad inputs to `filter_jit` (the training step) and to the options issue 20 added to
`like` and `filter_restore`."""

# Every case passes a bad argument on purpose, to check the error it raises: what a type
# checker says about those arguments is the point of this file, not a mistake in it.
# pyright: reportArgumentType=false, reportCallIssue=false

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

import eqxshard

from . import Case

_mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
_jit = eqxshard.filter_jit


def _call(fun, *args, **options):
    return lambda: _jit(fun, **options)(*args)


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]


CASES: list[Case] = [
    Case("filter_jit/fun", lambda: _jit(3), TypeError, r"callable `fun`"),
    Case("filter_jit/donate-str", lambda: _jit(abs, donate="most"), ValueError, r"`donate`"),
    Case(
        "filter_jit/donate-tree-leaf",
        lambda: _jit(abs, donate=(True, "yes")),
        TypeError,
        r"`donate`.*\n  1  str 'yes'",
    ),
    Case(
        "filter_jit/donate-tree-structure",
        _call(lambda x: x, jnp.ones(2), donate=(True, True)),
        ValueError,
        r"`donate` tree whose structure is not a prefix",
    ),
    Case(
        "filter_jit/donate-filter-result",
        _call(lambda x: x, jnp.ones(2), donate=lambda x: None),
        TypeError,
        r"`donate` filter.*\n  0  returned NoneType",
    ),
    Case(
        "filter_jit/in_shardings-leaf",
        lambda: _jit(abs, in_shardings=("data",)),
        TypeError,
        r"`in_shardings`.*\n  0  str 'data'",
    ),
    Case(
        "filter_jit/out_shardings-leaf",
        lambda: _jit(abs, out_shardings={"y": 1}),
        TypeError,
        r"`out_shardings`.*\n  y  int 1",
    ),
    Case(
        "filter_jit/in_shardings-structure",
        _call(lambda x: x, jnp.ones(8), in_shardings=(P(), P()), mesh=_mesh),
        ValueError,
        r"`in_shardings` whose structure is not a prefix",
    ),
    Case(
        "filter_jit/out_shardings-structure",
        _call(lambda x: x, jnp.ones(8), out_shardings=[P(), P()], mesh=_mesh),
        ValueError,
        r"`out_shardings` whose structure is not a prefix",
    ),
    Case(
        "filter_jit/in_shardings-axis",
        _call(lambda x: x, {"w": jnp.ones(8)}, in_shardings=P("rows"), mesh=_mesh),
        ValueError,
        r"In `in_shardings`.*(\n.*)*0\.w",
    ),
    Case(
        "filter_jit/out_shardings-indivisible",
        _call(lambda x: {"w": x}, jnp.ones(3), out_shardings=P("data"), mesh=_mesh),
        ValueError,
        r"In `out_shardings`.*(\n.*)*\n  w.*not divisible",
    ),
    Case(
        "filter_jit/spec-without-mesh",
        _call(lambda x: x, jnp.ones(8), in_shardings=P("data")),
        ValueError,
        r"`in_shardings` but no mesh.*\n  0",
    ),
    Case("filter_jit/mesh", lambda: _jit(abs, mesh=(2, 4)), TypeError, r"`mesh`"),
    Case("filter_jit/move_inputs", lambda: _jit(abs, move_inputs=1), TypeError, r"`move_inputs`"),
    Case(
        "filter_jit/kwargs-with-a-tree",
        lambda: _jit(lambda x, **kw: x, in_shardings=(P(),), mesh=_mesh)(
            jnp.ones(8), y=jnp.ones(8)
        ),
        ValueError,
        r"`in_shardings`.*`\*\*kwargs`",
    ),
    Case(
        "filter_jit/unhashable-static",
        _call(lambda x, y: x, jnp.ones(2), _Unhashable()),
        TypeError,
        r"hashable.*\n  args\.1  _Unhashable",
    ),
    Case(
        "filter_jit/move_inputs-false",
        _call(
            lambda x: x,
            eqxshard.filter_shard(jnp.ones((8, 4)), _mesh, P(None, "model")),
            in_shardings=P("data"),
            mesh=_mesh,
            move_inputs=False,
        ),
        ValueError,
        r"`move_inputs=False`.*\n  args\.0  is P\(None, 'model'\).*asked P\('data',\)",
    ),
    Case("like/min_size", lambda: eqxshard.like({}, min_size=-1), TypeError, r"`min_size`"),
    Case(
        "filter_restore/strict",
        lambda: eqxshard.filter_restore("/nonexistent", {}, strict="no"),  # type: ignore[arg-type]
        TypeError,
        r"`strict` as a bool",
    ),
    Case(
        "filter_restore/cast",
        lambda: eqxshard.filter_restore("/nonexistent", {}, cast=1),  # type: ignore[arg-type]
        TypeError,
        r"`cast` as a bool",
    ),
]
