"""What `filter_map` and `filter_stream` share: axes, batch sizes, the vmapped chunk body."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._tree import leaf_table, pathstr
from .stream_host import shape_of, streamable

_Axis = int | None
IF_ARRAY_0 = eqx.if_array(0)  # the default of `in_axes`/`out_axes`, as in `filter_vmap`
_SCALARS = (bool, int, float, complex, np.number, np.bool_)


def _is_none(x: Any) -> bool:
    return x is None


def named_in_axes(fun: Callable, in_axes: Any, args: tuple, name: str) -> Any:
    """`in_axes` as a tuple prefix of `args`: a dict keyed by argument name gives the named
    arguments its axes and every other argument the default `eqx.if_array(0)`."""
    if not isinstance(in_axes, dict):
        return in_axes
    try:
        params = list(inspect.signature(fun).parameters)
    except (TypeError, ValueError):
        raise TypeError(
            f"`{name}(in_axes=...)` is a dict keyed by argument name, but the signature of "
            f"`fun` ({fun!r}) cannot be read. Give `in_axes` as a tuple, one entry per "
            "argument."
        ) from None
    unknown = [k for k in in_axes if k not in params[: len(args)]]
    if unknown:
        raise ValueError(
            f"`{name}(in_axes=...)` names {unknown}, which are not among the arguments passed "
            f"to `fun` ({params[: len(args)]}). Key `in_axes` by the names of `fun`'s "
            "parameters, and pass those arguments positionally."
        )
    return tuple(in_axes.get(p, IF_ARRAY_0) for p in params[: len(args)])


def check_batch_size(
    batch_size: Any,
    name: str,
    *,
    allow_none: bool = True,
    allow_auto: bool = False,
    unit: str = "rows",
    none: str = "one row at a time",
) -> None:
    """Raises if `batch_size` is not `None` (when allowed), `"auto"` (when allowed) or a
    positive int. The messages say what a chunk counts (`unit`) and what `None` does."""
    auto = allow_auto and isinstance(batch_size, str) and batch_size == "auto"
    if auto or (batch_size is None and allow_none):
        return
    is_int = isinstance(batch_size, int | np.integer) and not isinstance(batch_size, bool)
    if not is_int:
        allowed = "`None` or a positive int" if allow_none else "a positive int"
        allowed += ' or `"auto"`' if allow_auto else ""
        raise TypeError(
            f"`{name}(batch_size=...)` must be {allowed}, got {batch_size!r} of type "
            f"{type(batch_size).__name__}. Pass the number of {unit} per chunk, e.g. "
            "`batch_size=32`."
        )
    if int(batch_size) <= 0:  # pyright: ignore[reportArgumentType]
        raise ValueError(
            f"`{name}(batch_size=...)` must be >= 1, got {batch_size}. Pass the number of "
            f"{unit} per chunk, e.g. `batch_size=32`"
            + (f", or `None` for {none}." if allow_none else ".")
        )


def resolve_axes(tree: Any, axes: Any, what: str, name: str) -> list[_Axis]:
    """One axis (`int` or `None`) per leaf of `tree`, in `jtu.tree_leaves` order.

    `axes` is a prefix PyTree of `tree` with `None`, ints or callables `leaf -> int | None`.
    """
    resolved: list[Any] = []

    def visit(spec: Any, subtree: Any) -> None:
        for leaf in jtu.tree_leaves(subtree):
            resolved.append(spec(leaf) if callable(spec) else spec)

    try:
        jtu.tree_map(visit, axes, tree, is_leaf=_is_none)
    except ValueError as e:
        raise ValueError(
            f"`{name}({what}=...)` must be a prefix of the {_WHAT[what]}'s PyTree "
            f"structure, but it is not:\n  {e}\nGive one axis spec per argument, or a "
            "single spec for all of them."
        ) from None
    bad = [a for a in resolved if a is not None and not is_int(a)]
    if bad:
        raise TypeError(
            f"`{name}({what}=...)` must hold only `None`, ints and callables returning "
            f"`None` or an int; got {bad!r}."
        )
    return [None if a is None else int(a) for a in resolved]


_WHAT = {"in_axes": "arguments tuple", "out_axes": "output"}


def is_int(x: Any) -> bool:
    """Whether `x` is an int (Python's or NumPy's), not a bool."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def path_table(paths: list[str], rows: list[str]) -> str:
    """Error rows of a path and one detail each, aligned as `leaf_error` aligns them."""
    return leaf_table(list(zip(paths, rows, strict=True)))


def check_axes_in_range(
    name: str, paths: list[str], axes: dict[int, int], ndims: dict[int, int], row: Callable
) -> None:
    """Raises naming every mapped leaf whose `in_axes` entry is not one of its `ndims`
    axes; `row(i)` describes leaf `i` after its path."""
    bad = [i for i, a in axes.items() if not -ndims[i] <= a < ndims[i]]
    if bad:
        raise ValueError(
            f"`{name}(in_axes=...)` names an axis these leaves do not have:\n"
            + path_table([paths[i] for i in bad], [row(i) for i in bad])
            + "\nUse an axis in range for each leaf's shape, or `None` to broadcast it."
        )


def check_same_size(
    name: str, paths: list[str], sizes: dict[int, int], what: str, row: Callable, fix: str
) -> int:
    """Raises unless the mapped leaves all have one `sizes[i]` (`what` names it, `row(i)`
    describes leaf `i`); returns it."""
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"`{name}` needs every mapped leaf to have the same {what}; got:\n"
            + path_table([paths[i] for i in sizes], [row(i) for i in sizes])
            + f"\n{fix}"
        )
    return next(iter(sizes.values()))


def check_mapped_leaves(
    paths: list[str], leaves: list[Any], axes: dict[int, int], name: str, *, host: bool = False
) -> int:
    """Checks the mapped leaves (`axes`: leaf index -> axis); returns the common size.

    `host=True` (`filter_stream`) also maps host objects that support `len(x)` and
    slicing along axis 0 (rows read a chunk at a time), not only arrays."""
    if host:
        bad = [i for i, a in axes.items() if not streamable(leaves[i], a)]
        rows = [f"{type(leaves[i]).__name__}  in_axes {axes[i]}" for i in bad]
        fix = "\nConvert them with `np.asarray`, or give them `in_axes=None` to broadcast them."
        header = (
            f"`{name}` streams rows of arrays or of host objects that support `len(x)` (or "
            "`x.shape`) and slicing `x[i:j]` along axis 0 (other axes: NumPy/JAX arrays "
            "only); these mapped leaves do not fit:\n"
        )
    else:
        bad = [i for i in axes if not hasattr(leaves[i], "shape")]
        rows = [type(leaves[i]).__name__ for i in bad]
        fix = "\nGive them `in_axes=None` (the default `eqx.if_array(0)` does)."
        header = f"`{name}` can only map over arrays, but `in_axes` maps these non-array leaves:\n"
    if bad:
        raise TypeError(header + path_table([paths[i] for i in bad], rows) + fix)
    shapes = {i: shape_of(leaves[i]) for i in axes}
    check_axes_in_range(
        name,
        paths,
        axes,
        {i: len(s) for i, s in shapes.items()},
        lambda i: (
            f"{len(shapes[i])} dims  in_axes {axes[i]}"
            if host
            else f"shape {shapes[i]}  in_axes {axes[i]}"
        ),
    )
    sizes = {i: shapes[i][axes[i]] for i in axes}
    if host:
        what, row = "number of rows", lambda i: f"{sizes[i]} rows"
        fix = "Slice them to one length, or broadcast some with `in_axes=None`."
    else:
        what = "size along its mapped axis"
        row = lambda i: f"shape {shapes[i]}  axis {axes[i]}  size {sizes[i]}"
        fix = "Slice or pad them to one size, or broadcast some with `in_axes=None`."
    return check_same_size(name, paths, sizes, what, row, fix)


class Trace:
    """What one trace of `fun` returned besides mapped arrays (`vmapped_body` records one
    per trace): the output's structure, its `out_axes`, its non-array leaves, and the
    paths of its unmapped arrays (`out_axes=None`)."""

    def __init__(
        self, treedef: Any, axes: list[_Axis], statics: list[Any], unmapped_paths: list[str]
    ):
        self.treedef, self.axes, self.statics = treedef, axes, statics
        self.unmapped_paths = unmapped_paths

    def output(self, mapped: list[Any], unmapped: list[Any], moveaxis: Callable) -> Any:
        """The output PyTree of this trace's structure: the `mapped` outputs (mapped axis
        first) with that axis moved to its `out_axes` by `moveaxis` (`jnp.moveaxis` or
        `np.moveaxis`), the `unmapped` arrays and the non-array leaves, in order."""
        mapped_iter, unmapped_iter = iter(mapped), iter(unmapped)
        leaves = []
        for a, s in zip(self.axes, self.statics, strict=True):
            if a is not None:
                leaves.append(moveaxis(next(mapped_iter), 0, a))
            elif s is None:
                leaves.append(next(unmapped_iter))
            else:
                leaves.append(s)
        return jtu.tree_unflatten(self.treedef, leaves)

    def same_as(self, other: Trace) -> bool:
        if self.treedef != other.treedef or self.axes != other.axes:
            return False
        return all(_same(a, b) for a, b in zip(self.statics, other.statics, strict=True))


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:
        return False


def vmapped_body(
    fun: Callable,
    args_def: Any,
    leaves: list[Any],
    idx: list[int],
    out_axes: Any,
    traces: list[Trace],
    name: str,
    axis_name: Hashable = None,
) -> Callable:
    """`vmap` of `fun` over the mapped leaves (at `idx` of `leaves`, mapped axis first),
    as a function of those leaves returning the mapped outputs (each axis first) and the
    unmapped ones. Each trace appends its `Trace` to `traces`; outputs not arrays or
    lacking their `out_axes`, and `out_axes=None` outputs that vary with the rows, are
    errors naming each, with `name` the verb."""

    def call(mapped: list[Any]) -> tuple[list[Any], list[Any]]:
        full = list(leaves)
        for i, x in zip(idx, mapped, strict=True):
            full[i] = x
        out = fun(*jtu.tree_unflatten(args_def, full))
        flat_out = jtu.tree_flatten_with_path(out)[0]
        out_paths, out_leaves = [p for p, _ in flat_out], [x for _, x in flat_out]
        axes = resolve_axes(out, out_axes, "out_axes", name)
        # A Python or NumPy scalar with an int `out_axes` is broadcast, as by `jax.vmap`.
        out_leaves = [
            jnp.asarray(x) if a is not None and isinstance(x, _SCALARS) else x
            for x, a in zip(out_leaves, axes, strict=True)
        ]
        bad = [
            i
            for i, (x, a) in enumerate(zip(out_leaves, axes, strict=True))
            if a is not None and (not eqx.is_array(x) or not -x.ndim - 1 <= a <= x.ndim)
        ]
        if bad:
            raise ValueError(
                f"`{name}(out_axes=...)` maps outputs that are not arrays or lack that axis:\n"
                + path_table(
                    [pathstr(out_paths[i], "out") for i in bad],
                    [
                        (
                            f"shape {tuple(out_leaves[i].shape)}"
                            if eqx.is_array(out_leaves[i])
                            else type(out_leaves[i]).__name__
                        )
                        + f"  out_axes {axes[i]}"
                        for i in bad
                    ],
                )
                + "\nGive non-array outputs `out_axes=None` (the default `eqx.if_array(0)` does)."
            )
        statics = [None if eqx.is_array(x) else x for x in out_leaves]
        unmapped_at = [
            i
            for i, (x, a) in enumerate(zip(out_leaves, axes, strict=True))
            if a is None and eqx.is_array(x)
        ]
        unmapped_paths = [pathstr(out_paths[i], "out") for i in unmapped_at]
        traces.append(Trace(jtu.tree_structure(out), axes, statics, unmapped_paths))
        mapped_out = [x for x, a in zip(out_leaves, axes, strict=True) if a is not None]
        return mapped_out, [out_leaves[i] for i in unmapped_at]

    def vmapped(unmapped_axes: Any) -> Callable:
        return jax.vmap(call, in_axes=(0,), out_axes=(0, unmapped_axes), axis_name=axis_name)

    def run(mapped: list[Any]) -> tuple[list[Any], list[Any]]:
        try:
            return vmapped(None)(mapped)
        except ValueError as e:
            varying = _varying_unmapped(e, vmapped, mapped, traces)
            if not varying:
                raise
            error = e
        raise ValueError(
            f"`{name}(out_axes=...)` is `None` for these outputs, but they vary with the "
            f"mapped rows:\n  " + "\n  ".join(varying) + "\nGive them an int `out_axes` "
            "(e.g. `0`), or compute them outside the mapped function."
        ) from error

    return run


def _varying_unmapped(
    error: ValueError, vmapped: Callable, mapped: list[Any], traces: list[Trace]
) -> list[str]:
    """The paths of the `out_axes=None` outputs that vary with the mapped rows, found by
    reading the index JAX names and tracing again with it mapped, until JAX is content."""
    varying: set[int] = set()
    while traces:
        match = re.search(r"out_axes\[1\]\[(\d+)\]", str(error))
        if match is None or int(match.group(1)) in varying:
            break
        varying.add(int(match.group(1)))
        paths = traces[-1].unmapped_paths
        try:
            jax.eval_shape(
                vmapped([0 if i in varying else None for i in range(len(paths))]), mapped
            )
        except ValueError as e:
            error = e
            continue
        return [paths[i] for i in sorted(varying)]
    return []
