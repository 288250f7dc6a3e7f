r"""Bad inputs to the mapping verbs: `filter_map` and `filter_stream`."""

# Every case passes a bad argument on purpose, to check the error it raises: what a type
# checker says about those arguments is the point of this file, not a mistake in it.
# pyright: reportArgumentType=false, reportCallIssue=false

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import eqxshard

from . import Case

_x = jnp.arange(21.0).reshape(7, 3)
_rows = np.arange(21.0).reshape(7, 3)
_mesh = jax.make_mesh((8,), ("rows",))


def _first_and_sum(x):
    return {"a": x, "b": x.sum(), "c": x[0]}


def _minus_mean(x):
    return x - jax.lax.pmean(x, "i")


CASES: list[Case] = [
    # `batch_size`
    Case(
        "filter_map/batch_size-float",
        lambda: eqxshard.filter_map(jnp.sin, batch_size=2.0),
        TypeError,
        r"`filter_map\(batch_size=\.\.\.\)` must be `None` or a positive int",
    ),
    Case(
        "filter_map/batch_size-bool",
        lambda: eqxshard.filter_map(jnp.sin, batch_size=True),
        TypeError,
        r"`filter_map\(batch_size=\.\.\.\)`.*got True of type bool",
    ),
    Case(
        "filter_map/batch_size-zero",
        lambda: eqxshard.filter_map(jnp.sin, batch_size=0),
        ValueError,
        r"`filter_map\(batch_size=\.\.\.\)` must be >= 1, got 0",
    ),
    Case(
        "filter_stream/batch_size-none",
        lambda: eqxshard.filter_stream(jnp.sin, batch_size=None),
        TypeError,
        r"`filter_stream\(batch_size=\.\.\.\)` must be a positive int",
    ),
    Case(
        "filter_stream/batch_size-negative",
        lambda: eqxshard.filter_stream(jnp.sin, batch_size=-4),
        ValueError,
        r"`filter_stream\(batch_size=\.\.\.\)` must be >= 1, got -4",
    ),
    Case(
        "filter_stream/batch_size-not-multiple-of-mesh",
        lambda: eqxshard.filter_stream(jnp.sin, batch_size=12, mesh=_mesh, progress=False)(_rows),
        ValueError,
        r"`filter_stream\(batch_size=12\)` must be a multiple of the 8 devices of `mesh`",
    ),
    # `fun`
    Case(
        "filter_map/fun-not-callable",
        lambda: eqxshard.filter_map(3, batch_size=2),
        TypeError,
        r"`filter_map\(fun\)` must be callable, got int",
    ),
    Case(
        "filter_stream/fun-not-callable",
        lambda: eqxshard.filter_stream("sin", batch_size=2),
        TypeError,
        r"`filter_stream\(fun\)` must be callable, got str",
    ),
    # `in_axes`
    Case(
        "filter_map/in_axes-out-of-range",
        lambda: eqxshard.filter_map(lambda t: t, in_axes=2)({"w": _x, "b": _x[0]}),
        ValueError,
        r"`filter_map\(in_axes=\.\.\.\)` names an axis(.|\n)*args\.0\.b(.|\n)*"
        r"args\.0\.w",
    ),
    Case(
        "filter_stream/in_axes-out-of-range",
        lambda: eqxshard.filter_stream(jnp.sin, batch_size=2, in_axes=(2,), progress=False)(_rows),
        ValueError,
        r"`filter_stream\(in_axes=\.\.\.\)` names an axis(.|\n)*args\.0  2 dims  in_axes 2",
    ),
    Case(
        "filter_map/in_axes-not-prefix",
        lambda: eqxshard.filter_map(lambda x, y: x, in_axes=(0, 0, 0))(_x, _x),
        ValueError,
        r"`filter_map\(in_axes=\.\.\.\)` must be a prefix",
    ),
    Case(
        "filter_map/in_axes-not-an-axis",
        lambda: eqxshard.filter_map(jnp.sin, in_axes="rows")(_x),
        TypeError,
        r"`filter_map\(in_axes=\.\.\.\)` must hold only `None`, ints and callables",
    ),
    Case(
        "filter_map/in_axes-dict-unknown-name",
        lambda: eqxshard.filter_map(lambda x, y: x + y, in_axes=dict(z=1))(_x, _x),
        ValueError,
        r"`filter_map\(in_axes=\.\.\.\)` names \['z'\], which are not among the arguments",
    ),
    Case(
        "filter_stream/in_axes-dict-unknown-name",
        lambda: eqxshard.filter_stream(
            lambda x: x, batch_size=2, in_axes=dict(rows=0), progress=False
        )(_rows),
        ValueError,
        r"`filter_stream\(in_axes=\.\.\.\)` names \['rows'\]",
    ),
    Case(
        "filter_map/maps-a-non-array",
        lambda: eqxshard.filter_map(lambda x, s: x, in_axes=0)(_x, "label"),
        TypeError,
        r"`in_axes` maps these non-array leaves:\n  args\.1  str",
    ),
    Case(
        "filter_map/mapped-sizes-differ",
        lambda: eqxshard.filter_map(jnp.add, batch_size=2)(_x, _x[:5]),
        ValueError,
        r"same size along its mapped axis(.|\n)*args\.0 +shape \(7, 3\)(.|\n)*args\.1 +shape "
        r"\(5, 3\)",
    ),
    Case(
        "filter_stream/rows-differ",
        lambda: eqxshard.filter_stream(jnp.add, batch_size=2, progress=False)(_rows, _rows[:5]),
        ValueError,
        r"same number of rows(.|\n)*args\.0  7 rows\n  args\.1  5 rows",
    ),
    # `out_axes`
    Case(
        "filter_map/out_axes-none-varies",
        lambda: eqxshard.filter_map(
            _first_and_sum, batch_size=3, out_axes={"a": 0, "b": None, "c": None}
        )(_x),
        ValueError,
        r"`filter_map\(out_axes=\.\.\.\)` is `None` for these outputs, but they vary with "
        r"the mapped rows:\n  out\.b\n  out\.c",
    ),
    Case(
        "filter_stream/out_axes-none-varies",
        lambda: eqxshard.filter_stream(
            _first_and_sum, batch_size=3, out_axes={"a": 0, "b": None, "c": 0}, progress=False
        )(_rows),
        ValueError,
        r"`filter_stream\(out_axes=\.\.\.\)` is `None` for these outputs(.|\n)*out\.b",
    ),
    Case(
        "filter_map/out_axes-out-of-range",
        lambda: eqxshard.filter_map(_first_and_sum, batch_size=3, out_axes=3)(_x),
        ValueError,
        r"`filter_map\(out_axes=\.\.\.\)` maps outputs(.|\n)*out\.a  shape \(3,\)  out_axes 3",
    ),
    # `axis_name` / `axis_size`
    Case(
        "filter_map/axis_name-unhashable",
        lambda: eqxshard.filter_map(jnp.sin, axis_name=["i"]),
        TypeError,
        r"`filter_map\(axis_name=\.\.\.\)` must be hashable",
    ),
    Case(
        "filter_map/axis_name-collective-in-chunks",
        lambda: eqxshard.filter_map(_minus_mean, batch_size=3, axis_name="i")(_x),
        ValueError,
        r"`filter_map\(axis_name='i'\)`: `fun` uses collectives over the mapped axis \(pmean|"
        r"`filter_map\(axis_name='i'\)`: `fun` uses collectives over the mapped axis \(psum",
    ),
    Case(
        "filter_map/axis_size-not-int",
        lambda: eqxshard.filter_map(jnp.sin, axis_size=7.0),
        TypeError,
        r"`filter_map\(axis_size=\.\.\.\)` must be `None` or an int",
    ),
    Case(
        "filter_map/axis_size-negative",
        lambda: eqxshard.filter_map(jnp.sin, axis_size=-1),
        ValueError,
        r"`filter_map\(axis_size=\.\.\.\)` must be >= 0",
    ),
    Case(
        "filter_map/axis_size-differs",
        lambda: eqxshard.filter_map(jnp.sin, batch_size=2, axis_size=5)(_x),
        ValueError,
        r"`filter_map\(axis_size=5\)` differs from the size 7 of the mapped axis",
    ),
    # `mesh`, `desc`, traced arguments
    Case(
        "filter_stream/mesh-not-a-mesh",
        lambda: eqxshard.filter_stream(
            jnp.sin,
            batch_size=8,
            mesh=jax.devices()[0],
            progress=False,
        )(_rows),
        TypeError,
        r"`filter_stream\(mesh=\.\.\.\)` must be a `jax.sharding.Mesh` or `None`, got",
    ),
    Case(
        "filter_stream/desc-not-a-string",
        lambda: eqxshard.filter_stream(jnp.sin, batch_size=2, desc=3),
        TypeError,
        r"`filter_stream\(desc=\.\.\.\)` must be a string",
    ),
    Case(
        "filter_stream/under-jit",
        lambda: jax.jit(eqxshard.filter_stream(jnp.add, batch_size=2, progress=False))(_x, _x),
        TypeError,
        r"these arguments are traced: args\.0, args\.1",
    ),
    Case(
        "filter_map/memory_budget-inf",
        lambda: eqxshard.filter_map(jnp.sin, batch_size="auto", memory_budget=float("inf")),
        ValueError,
        r"`filter_map\(memory_budget=\.\.\.\)` must be a finite number > 0 of bytes, got inf",
    ),
    Case(
        "filter_map/remat-str",
        lambda: eqxshard.filter_map(jnp.sin, remat="yes"),
        TypeError,
        r"`filter_map\(remat=\.\.\.\)` must be a bool, got str",
    ),
    Case(
        "filter_map/str-array",
        lambda: eqxshard.filter_map(lambda s, x: x)(np.array(["a", "b"]), jnp.ones(2)),
        TypeError,
        r"dtype JAX has no arrays of:\n  args\.0  dtype <U1",
    ),
    Case(
        "filter_stream/str-array",
        lambda: eqxshard.filter_stream(lambda s: s, batch_size=2, progress=False)(
            np.array(["a", "b", "c"])
        ),
        TypeError,
        r"`filter_stream` got array arguments whose dtype JAX has no arrays of:\n  args\.0",
    ),
]
