"""What a `filter_jit` call resolves once per static part and input signature, and reuses
at every later call like it: the `jax.jit` (with `in_shardings`, `out_shardings` and
donation over the array leaves), the layouts to hold the inputs to, and how the array
leaves are handed to the `jax.jit`.

The array leaves go in their flattening order, as runs: each run a list of consecutive
leaves that are all donated or all kept (one run when nothing or everything is donated),
so that `donate_argnums` picks whole runs. The program is the one a hand-written
`jax.jit` over the leaves compiles (JAX flattens the lists into the same parameters), and
JAX's dispatch takes a few lists faster than hundreds of positional arguments.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from .._caches import register
from .._compat import is_tracer, tracing_on
from .._placement import place as _place
from .._tree import Flat, is_array_like, leaf_error
from . import donate as _donate, layouts as _layouts
from .leaves import UNSET, call_path


class Static(eqx.Module):
    """The non-array part of an output, carried through `jax.jit` as tree metadata."""

    value: Any = eqx.field(static=True)


# One traced function per static part of a call (and per `filter_jit` configuration):
# shared by every wrapper of an equal function, as `eqx.filter_jit` shares its cache.
FUNS: dict[Any, Any] = {}
# One `jax.jit` per traced function and arguments to `jax.jit`.
JITS: dict[Any, Any] = {}
register(FUNS.clear)
register(JITS.clear)
_NEVER: Any = object()  # no input seen laid out as asked yet
_SHARDING = operator.attrgetter("sharding")


class Entry:
    """One static part and input signature of a call: its `jax.jit` and layouts.

    - `runs`: `(start, stop)` of each run of array leaves given to `jitted`.
    - `in_shardings`: leaf index (in the call's flattening) -> its sharding.
    - `positions`: the index among the array leaves of each leaf in `in_shardings`;
        `known`: for each, the sharding object of an input last found laid out as asked
        (an input with that very object needs no check).
    """

    def __init__(self, jitted: Any, runs, in_shardings, positions, suppress):
        self.jitted: Any = jitted
        self.runs, self.in_shardings = runs, in_shardings
        self.positions: list[int] = positions
        self.known: list[Any] = [_NEVER] * len(positions)
        # Every array leaf has a layout, in order: the steady-path check reads them whole.
        self.in_order = positions == list(range(len(positions)))
        self.suppress: bool = suppress

    def runs_of(self, dynamic: list[Any]) -> list[list[Any]]:
        if len(self.runs) == 1:
            return [dynamic]
        return [dynamic[a:b] for a, b in self.runs]


def traced_fun(
    key: Any, static: tuple, treedef: Any, name: tuple[str, str], mesh: Any = None
) -> Any:
    """The function `jax.jit` traces for a call: `fun(*args, **kwargs)` from the array
    leaves, traced with `mesh` (`filter_jit`'s) in context where JAX needs it there."""
    found = FUNS.get(key)
    if found is not None:
        return found

    def fun(*runs: Any) -> Any:
        it = iter([x for run in runs for x in run])
        leaves = [next(it) if s is UNSET else s for s in static]
        call_fun, args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        with tracing_on(mesh):
            out = call_fun(*args, **kwargs)
        out_leaves, out_def = jax.tree_util.tree_flatten(out)
        arrays = [x for x in out_leaves if eqx.is_array(x)]
        rest = tuple(UNSET if eqx.is_array(x) else x for x in out_leaves)
        return arrays, Static((out_def, rest))

    fun.__name__, fun.__qualname__ = name
    FUNS[key] = fun
    return fun


def output(out: Any) -> Any:
    """The user's output from what the traced function returns (its arrays, and the rest
    as tree metadata); also the abstract output, from `out_info`."""
    arrays, static = out
    out_def, rest = static.value
    it = iter(arrays)
    return jax.tree_util.tree_unflatten(out_def, [next(it) if x is UNSET else x for x in rest])


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    start = 0
    for n in range(1, len(flags) + 1):
        if n == len(flags) or flags[n] != flags[start]:
            runs.append((start, n))
            start = n
    return runs or [(0, 0)]


def build(
    config: Any, fun: Any, key: Any, flat: Flat, args: tuple, kwargs: dict, name: tuple[str, str]
) -> tuple[Entry, list[Any]]:
    """The entry of a call seen for the first time, and its array leaves laid out."""
    fun_leaves = jax.tree_util.tree_leaves(fun)
    static = tuple(UNSET if a else x for x, a in zip(flat.leaves, flat.is_array, strict=True))
    traced = traced_fun(key, static, flat.treedef, name, config.mesh)
    flags = sum(_donate.donated(config.donate, fun_leaves, args, kwargs), [])
    arrays = flat.array_indices
    donated = [flags[i] for i in arrays]
    runs = _runs(donated)
    donate_argnums = tuple(k for k, (a, b) in enumerate(runs) if b > a and donated[a])
    in_shardings: dict[int, Any] = {}
    if config.in_shardings is not None:
        n_fun = len(fun_leaves)
        n_args = len(jax.tree_util.tree_leaves(args))
        tree: Any = args
        if _layouts.is_layout_leaf(config.in_shardings):
            tree, n_args = (args, kwargs), len(flat.leaves) - n_fun
        else:
            _no_kwargs(flat, n_fun + n_args)
        found = _layouts.resolve_layouts(
            tree, config.in_shardings, mesh=config.mesh, argname="in_shardings"
        )
        in_shardings = {n_fun + i: s for i, s in found.items()}
    position = {i: n for n, i in enumerate(arrays)}
    entry = Entry(
        None,
        runs,
        in_shardings,
        [position[i] for i in in_shardings],
        _donate.suppress_warning(config.donate),
    )
    dynamic = [x for x, a in zip(flat.leaves, flat.is_array, strict=True) if a]
    if in_shardings:
        dynamic = lay_out(entry, config, dynamic, True, lambda: flat)
    kw: dict[str, Any] = {"donate_argnums": donate_argnums}
    if in_shardings:
        per_leaf = [in_shardings.get(i) for i in arrays]
        kw["in_shardings"] = tuple(per_leaf[a:b] for a, b in runs)
    if config.out_shardings is not None:
        out_info = jax.jit(traced, **kw).trace(*entry.runs_of(dynamic)).out_info
        abstract = output(out_info)
        found = _layouts.resolve_layouts(
            abstract, config.out_shardings, mesh=config.mesh, argname="out_shardings"
        )
        out_flat = Flat(abstract, is_array=is_array_like)
        kw["out_shardings"] = ([found.get(i) for i in out_flat.array_indices], None)
    jit_key = (
        key,
        tuple(runs),
        donate_argnums,
        tuple(map(tuple, kw.get("in_shardings", ()))),
        tuple(kw.get("out_shardings", ((),))[0]),
    )
    jitted = JITS.get(jit_key)
    if jitted is None:
        jitted = JITS[jit_key] = jax.jit(traced, **kw)
    entry.jitted = jitted
    return entry, dynamic


def lay_out(
    entry: Entry, config: Any, dynamic: list[Any], traced: bool, flat: Callable[[], Flat]
) -> list[Any]:
    """The array leaves laid out as `in_shardings` asks (or checked to be, with
    `move_inputs=False`).

    Outside a trace, an input whose sharding is the very object last found right needs
    no check (the steady path of a step fed its own outputs, or the same batch layout);
    the others go the way `filter_shard` goes, all in one batched transfer. `flat` gives
    the call's leaves with their paths, for that and for errors."""
    positions = entry.positions
    if not positions:
        return dynamic
    known = entry.known
    if traced:
        wrong = list(range(len(positions)))
    else:
        # The steady path, in C: every input's sharding is the very one last found right.
        # (NumPy leaves have no `sharding`: they go the per-leaf way below.)
        try:
            got = map(
                _SHARDING,
                dynamic
                if entry.in_order and len(positions) == len(dynamic)
                else map(dynamic.__getitem__, positions),
            )
            if all(map(operator.is_, got, known)):
                return dynamic
        except AttributeError:
            pass
        wrong = [
            k
            for k, p in enumerate(positions)
            if getattr(dynamic[p], "sharding", None) is not known[k]
        ]
        if not wrong:
            return dynamic
    whole = flat()
    indices = list(entry.in_shardings)
    asked = {indices[k]: entry.in_shardings[indices[k]] for k in wrong}
    if config.move_inputs:
        moved = _layouts.move_inputs(whole, asked)
    else:
        _layouts.check_inputs(whole, asked)
        moved = {}
    laid = list(dynamic)
    for k in wrong:
        i, p = indices[k], positions[k]
        x = moved.get(i)
        if x is not None:
            laid[p] = x
        x = laid[p]
        if isinstance(x, jax.Array) and not is_tracer(x) and x.committed:
            if _place.already_placed(x, asked[i]):
                known[k] = x.sharding
    return laid


def _no_kwargs(flat: Flat, end: int) -> None:
    rows = [(call_path(flat.paths[i]),) for i in flat.array_indices if i >= end]
    if rows:
        raise ValueError(
            leaf_error(
                "`filter_jit` got `in_shardings` as a tree over the positional arguments, "
                "but these array leaves come in through `**kwargs`:",
                rows,
                "Pass them by position, or give `in_shardings` as one layout for all leaves.",
            )
        )
