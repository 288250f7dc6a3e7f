"""What the Jacobian verbs differentiate, and the dtypes of what they return, as
`jax.jacfwd`/`jax.jacrev` (and so `eqx.filter_jac*`, which have no `holomorphic`) decide:
forward mode needs real inputs, reverse mode real outputs; each block of the Jacobian has
the dtype and weak type of its output leaf (forward) or input leaf (reverse).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from .._compat import astype_weak
from .._tree import leaf_error, pathstr, shape_str


def _what(x: Any) -> str:
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return f"{jnp.dtype(x.dtype).name}{shape_str(x.shape)}"
    return f"{type(x).__name__} {x!r}"[:60]


def _real(x: Any) -> bool:
    """Whether `x` is real floating-point as JAX reads it (a Python float is); a leaf that
    is no JAX type counts as real here: JAX rejects it with its own message."""
    if hasattr(x, "dtype"):
        dtype = x.dtype
    elif isinstance(x, bool | int | float | complex):
        dtype = jnp.result_type(x)
    else:
        return True
    return bool(jnp.issubdtype(dtype, jnp.floating))


def check_inputs(name: str, rev: bool, x: Any) -> None:
    """Raises where `jax.jac*` (and Equinox) raise on the first argument `x`, naming the
    leaves: when it has no floating-point array leaf (nothing to differentiate), and, in
    forward mode, when one of them is complex."""
    leaves = jtu.tree_leaves_with_path(x, is_leaf=lambda v: v is None)
    diff = [(p, v) for p, v in leaves if eqx.is_inexact_array(v)]
    if not diff:
        rows = [(pathstr(p), _what(v)) for p, v in leaves] or [("<root>", "no leaves")]
        raise ValueError(
            leaf_error(
                f"`{name}` differentiates the floating-point array leaves of its first "
                "argument, but it has none (integer arrays and Python numbers are held "
                f"fixed, as in `eqx.{name}`):",
                rows,
                "Pass what to differentiate as a floating-point array, e.g. "
                "`jnp.asarray(x, dtype=float)`.",
            )
        )
    complex_ = [(p, v) for p, v in diff if jnp.issubdtype(v.dtype, jnp.complexfloating)]
    if not rev and complex_:
        raise TypeError(
            leaf_error(
                f"`{name}` (forward mode) needs real-valued inputs, as `jax.jacfwd` and "
                f"`eqx.{name}` do, but these leaves of the first argument are complex:",
                [(pathstr(p), _what(v)) for p, v in complex_],
                "Differentiate their real and imaginary parts as separate real arrays, or "
                "use `jax.jvp` directly.",
            )
        )


def check_outputs(name: str, out: Any) -> None:
    """Raises, in reverse mode, where `jax.jacrev` raises on `fun`'s output: every leaf
    must be a real floating-point array (an integer output has no reverse-mode Jacobian,
    a complex one needs `holomorphic`, which `eqx.filter_jacrev` does not have)."""
    bad = [(pathstr(p), _what(v)) for p, v in jtu.tree_leaves_with_path(out) if not _real(v)]
    if bad:
        raise TypeError(
            leaf_error(
                f"`{name}` (reverse mode) needs real floating-point outputs, as `jax.jacrev` "
                f"and `eqx.{name}` do, but these leaves of the output are not:",
                bad,
                "Return integer or boolean results as `aux` (`has_aux=True`), split complex "
                "ones into real and imaginary parts, or use forward mode (`filter_jacfwd`) "
                "or `jax.vjp` directly.",
            )
        )


def like(block: Any, example: Any) -> Any:
    """`block` in the dtype and weak type of `example`, as `jax.jac*` return each block:
    forward mode like its output leaf (integer outputs: integer zeros), reverse mode like
    its input leaf."""
    return astype_weak(block, example.dtype, getattr(example, "weak_type", False))
