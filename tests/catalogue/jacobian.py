"""Bad inputs to the Jacobian verbs and to `batch_size="auto"` / `memory_budget`."""

# Every case passes a bad argument on purpose, to check the error it raises: what a type
# checker says about those arguments is the point of this file, not a mistake in it.
# pyright: reportArgumentType=false, reportCallIssue=false

from __future__ import annotations

import jax
import jax.numpy as jnp

import eqxshard

from . import Case

_mesh = jax.make_mesh((2, 4), ("data", "model"))
_x = jnp.ones(8)


def _f(x):
    return jnp.sin(x)


def _big(x):  # temporaries of a few 64 x 64 matrices per row
    m = jnp.outer(x, x)
    return jnp.tanh(m @ m).sum(0)


CASES: list[Case] = [
    Case(
        "jacrev/batch_size-zero",
        lambda: eqxshard.filter_jacrev(_f, batch_size=0),
        ValueError,
        # A chunk counts basis vectors, and `None` is Equinox's program (not one at a time).
        r"`filter_jacrev\(batch_size.*basis vectors per chunk.*`None` for all at once",
    ),
    Case(
        "jacfwd/batch_size-float",
        lambda: eqxshard.filter_jacfwd(_f, batch_size=2.5),
        TypeError,
        r"`filter_jacfwd\(batch_size",
    ),
    Case(
        "jacrev/batch_size-string",
        lambda: eqxshard.filter_jacrev(_f, batch_size="all"),
        TypeError,
        r"`filter_jacrev\(batch_size",
    ),
    Case(
        "hessian/batch_size-negative",
        lambda: eqxshard.filter_hessian(_f, batch_size=-1),
        ValueError,
        r"`filter_hessian\(batch_size",
    ),
    Case(
        "jacrev/memory_budget-negative",
        lambda: eqxshard.filter_jacrev(_f, batch_size="auto", memory_budget=-1),
        ValueError,
        r"`filter_jacrev\(memory_budget",
    ),
    Case(
        "jacrev/memory_budget-string",
        lambda: eqxshard.filter_jacrev(_f, batch_size="auto", memory_budget="1GB"),
        TypeError,
        r"`filter_jacrev\(memory_budget",
    ),
    Case(
        "jacfwd/memory_budget-without-auto",
        lambda: eqxshard.filter_jacfwd(_f, batch_size=4, memory_budget=2**20),
        ValueError,
        r"`filter_jacfwd\(memory_budget.*`batch_size=\"auto\"`",
    ),
    Case(
        "jacrev/auto-no-budget-on-cpu",
        lambda: eqxshard.filter_jacrev(_f, batch_size="auto")(_x),
        ValueError,
        r"`memory_budget=`",
    ),
    Case(
        "jacrev/auto-budget-too-small",
        lambda: eqxshard.filter_jacrev(_big, batch_size="auto", memory_budget=1)(jnp.ones(64)),
        ValueError,
        r"`memory_budget=1`",
    ),
    Case(
        "jacrev/not-callable",
        lambda: eqxshard.filter_jacrev(3),
        TypeError,
        r"`filter_jacrev\(fun\)`",
    ),
    Case(
        "jacrev/mesh-not-a-mesh",
        lambda: eqxshard.filter_jacrev(_f, mesh="data"),
        TypeError,
        r"`filter_jacrev\(mesh",
    ),
    Case(
        "jacrev/axis-without-mesh",
        lambda: eqxshard.filter_jacrev(_f, axis="data"),
        ValueError,
        r"`filter_jacrev\(axis",
    ),
    Case(
        "jacfwd/axis-unknown",
        lambda: eqxshard.filter_jacfwd(_f, mesh=_mesh, axis="batch"),
        ValueError,
        r"`filter_jacfwd\(axis",
    ),
    Case(
        "jacfwd/axis-not-names",
        lambda: eqxshard.filter_jacfwd(_f, mesh=_mesh, axis=0),
        TypeError,
        r"`filter_jacfwd\(axis",
    ),
    Case(
        "jacrev/batch_size-not-multiple-of-devices",
        lambda: eqxshard.filter_jacrev(_f, batch_size=6, mesh=_mesh),
        ValueError,
        r"`filter_jacrev\(batch_size=6\)`",
    ),
    Case(
        "map/memory_budget-without-auto",
        lambda: eqxshard.filter_map(_f, batch_size=2, memory_budget=10),
        ValueError,
        r"`filter_map\(memory_budget",
    ),
    Case(
        "map/auto-no-budget-on-cpu",
        lambda: eqxshard.filter_map(_f, batch_size="auto")(jnp.ones((4, 2))),
        ValueError,
        r"`memory_budget=`",
    ),
    Case(
        "map/auto-budget-too-small",
        lambda: eqxshard.filter_map(jax.jacrev(_big), batch_size="auto", memory_budget=1)(
            jnp.ones((4, 64))
        ),
        ValueError,
        r"`filter_map\(batch_size=\"auto\"\)`",
    ),
]
