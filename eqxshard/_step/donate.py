"""`donate=` of `filter_jit`: which array leaves of a call give their buffers to its outputs.

Equinox's strings donate whole groups (`"all"`, `"all-except-first"`, their `"warn"`
forms, `"none"`); beyond them a filter (`leaf -> bool`) or a prefix tree of bools picks
single leaves, so donating the parameters and optimiser state but not the batch needs no
rearranged arguments (equinox #1129).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._compat import is_tracer
from .._tree import leaf_error, pathstr

STRINGS = ("all", "all-except-first", "warn", "warn-except-first", "none")


def check(donate: Any) -> None:
    """Raises for a `donate` that is none of the accepted forms (before any call)."""
    if isinstance(donate, str):
        if donate not in STRINGS:
            raise ValueError(
                f"`filter_jit` takes `donate` as one of {', '.join(map(repr, STRINGS))}, a "
                f"filter `leaf -> bool` or a prefix tree of bools, but got the string "
                f"{donate!r}."
            )
        return
    if callable(donate) and not isinstance(donate, eqx.Module):
        return
    bad = [
        (pathstr(p), f"{type(x).__name__} {x!r}")
        for p, x in jax.tree_util.tree_flatten_with_path(donate)[0]
        if not isinstance(x, (bool, np.bool_))
    ]
    if bad:
        raise TypeError(
            leaf_error(
                "`filter_jit` takes `donate` as a string, a filter `leaf -> bool`, or a prefix "
                "tree of bools over the positional arguments, but this tree has other leaves:",
                bad,
                "Put `True` (donate) or `False` (keep) at each of these paths.",
            )
        )


def suppress_warning(donate: Any) -> bool:
    """Whether JAX's "Some donated buffers were not usable" warning is silenced, as
    Equinox does for `"all"` and `"all-except-first"`."""
    return donate in ("all", "all-except-first") if isinstance(donate, str) else False


def donated(
    donate: Any, fun_leaves: list[Any], args: tuple, kwargs: dict
) -> tuple[list[bool], list[bool], list[bool]]:
    """For each leaf of `fun`, of `args` and of `kwargs` (in flattening order): whether it
    is donated. Only array leaves are ever donated."""
    arg_leaves = jax.tree_util.tree_leaves(args)
    kwarg_leaves = jax.tree_util.tree_leaves(kwargs)
    if isinstance(donate, str):
        every = donate in ("all", "warn")
        rest = donate != "none"
        first = len(jax.tree_util.tree_leaves(args[:1]))
        return (
            [rest] * len(fun_leaves),
            [every] * first + [rest] * (len(arg_leaves) - first),
            [rest] * len(kwarg_leaves),
        )
    if callable(donate) and not isinstance(donate, eqx.Module):
        return _by_filter(donate, fun_leaves, args, kwargs)
    flags = _by_tree(donate, args)
    return [False] * len(fun_leaves), flags, [False] * len(kwarg_leaves)


def _by_filter(
    donate: Any, fun_leaves: list[Any], args: tuple, kwargs: dict
) -> tuple[list[bool], list[bool], list[bool]]:
    out: list[list[bool]] = []
    bad = []
    for name, tree in (("<fun>", fun_leaves), ("", args), ("<kwargs>", kwargs)):
        flags = []
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not eqx.is_array(x):
                flags.append(False)
                continue
            value = donate(x)
            if not isinstance(value, (bool, np.bool_)):
                bad.append((pathstr(path, name), f"returned {type(value).__name__} {value!r}"))
                value = False
            flags.append(bool(value))
        out.append(flags)
    if bad:
        raise TypeError(
            leaf_error(
                "`filter_jit`'s `donate` filter must return a bool for each array leaf, but "
                "for these it did not:",
                bad,
                "Return `True` to donate a leaf, `False` to keep it.",
            )
        )
    return out[0], out[1], out[2]


def _by_tree(donate: Any, args: tuple) -> list[bool]:
    is_leaf = lambda x: isinstance(x, (bool, np.bool_))
    flags: list[bool] = []

    def visit(_: Any, value: Any, subtree: Any) -> None:
        flags.extend([bool(value)] * len(jax.tree_util.tree_leaves(subtree)))

    if is_leaf(donate):
        return [bool(donate)] * len(jax.tree_util.tree_leaves(args))
    try:
        jax.tree_util.tree_map_with_path(visit, donate, args, is_leaf=is_leaf)
    except ValueError as e:
        raise ValueError(
            "`filter_jit` got a `donate` tree whose structure is not a prefix of the "
            "positional arguments.\n"
            f"{str(e).replace('tree_map_with_path tree', '`donate`')}\n"
            "Give `donate` one entry per positional argument (a tuple), each `True`, "
            "`False` or a tree of them shaped like (a prefix of) that argument."
        ) from None
    return flags


def deleted_inputs(fun: Any, args: tuple, kwargs: dict) -> ValueError | None:
    """The error for a call given arrays that an earlier call donated (JAX's own says
    only "Array has been deleted"), naming each; `None` if no input is deleted."""
    rows = []
    for name, tree in (("<fun>", fun), ("", args), ("<kwargs>", kwargs)):
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if isinstance(x, jax.Array) and not is_tracer(x) and x.is_deleted():
                rows.append((pathstr(path, name), f"shape {x.shape}", "deleted"))
    if not rows:
        return None
    return ValueError(
        leaf_error(
            "`filter_jit` was called with arrays whose buffers an earlier call donated (and "
            "so deleted):",
            rows,
            "A donated array cannot be used again: pass the outputs of the call that took "
            "it. `donate='all'` also donates the arrays of `fun` itself (a callable module, "
            "a bound method such as `model.__call__`), as `eqx.filter_jit` does, and the "
            "`self` of a method decorated in the class body (its first argument): keep them "
            "with `donate='all-except-first'` (for `self`) or a `donate` tree over the "
            "arguments, such as `(True, False)` (the arrays of `fun` are then kept).",
        )
    )
