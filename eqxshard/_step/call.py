"""How a `filter_jit` call runs: its cache, its `jax.jit`s, and what `lower` returns.

A call flattens `(fun, args, kwargs)` once: array leaves are traced, the rest (with the
tree structure) is held static and is the cache key, as in `eqx.filter_jit`. For each key
one Python function is traced, by one `jax.jit` per input signature (shapes and dtypes)
that carries the resolved `in_shardings`, `out_shardings` and `donate_argnums` over the
array leaves in their flattening order: the very program a hand-written `jax.jit` with
those arguments compiles. JAX's own trace cache is keyed by that function, so a key is
traced once however many `jax.jit`s share it (one more only where `out_shardings` needs
the output's structure first: then the trace is done first and reused).
"""

from __future__ import annotations

import functools as ft
import inspect
import os
import warnings
from typing import Any

import equinox as eqx
import jax

from .._compat import equinox_runtime_error, is_tracer
from .._tree import Flat, is_array_like, leaf_error
from . import donate as _donate, layouts as _layouts, sharding_note as _sharding_note
from .static import call_path, hashable_key

_UNSET: Any = object()


class _Static(eqx.Module):
    """The non-array part of an output, carried through `jax.jit` as tree metadata."""

    value: Any = eqx.field(static=True)


# One traced function per static part of a call (and per `filter_jit` configuration):
# shared by every wrapper of an equal function, as `eqx.filter_jit` shares its cache.
_FUNS: dict[Any, Any] = {}
# The `jax.jit` (and resolved layouts) per static part and input signature.
_JITS: dict[Any, _Entry] = {}


class _Entry:
    def __init__(self, jitted: Any, in_shardings: dict[int, Any], suppress: bool):
        self.jitted, self.in_shardings, self.suppress = jitted, in_shardings, suppress


def _traced_fun(key: Any, static: tuple, name: tuple[str, str]) -> Any:
    found = _FUNS.get(key)
    if found is not None:
        return found
    treedef, static_leaves = static

    def fun(*dynamic: Any) -> Any:
        it = iter(dynamic)
        leaves = [next(it) if s is _UNSET else s for s in static_leaves]
        call_fun, args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        out = call_fun(*args, **kwargs)
        out_leaves, out_def = jax.tree_util.tree_flatten(out)
        arrays = [x for x in out_leaves if eqx.is_array(x)]
        rest = tuple(_UNSET if eqx.is_array(x) else x for x in out_leaves)
        return arrays, _Static((out_def, rest))

    fun.__name__, fun.__qualname__ = name
    _FUNS[key] = fun
    return fun


def _output(out: Any) -> Any:
    """The user's output from what the traced function returns (its arrays, and the rest
    as tree metadata); also the abstract output, from `out_info`."""
    arrays, static = out
    out_def, rest = static.value
    it = iter(arrays)
    return jax.tree_util.tree_unflatten(out_def, [next(it) if x is _UNSET else x for x in rest])


class _JitWrapper(eqx.Module):
    fn: str  # for a readable repr only
    _fun: Any
    _signature: inspect.Signature | None = eqx.field(static=True, repr=False)
    _config: Any = eqx.field(static=True, repr=False)

    @property
    def __wrapped__(self) -> Any:
        return self._fun

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        with _sharding_note.explained(self._config, args, kwargs):
            return _call(self, args, kwargs, lower=False)

    def lower(self, /, *args: Any, **kwargs: Any) -> Lowered:
        """The `jax.stages.Lowered` of this call, wrapped so that `.compile()` returns a
        callable taking the same arguments."""
        with _sharding_note.explained(self._config, args, kwargs):
            return _call(self, args, kwargs, lower=True)

    def __get__(self, instance: Any, owner: Any) -> Any:
        if instance is None:
            return self
        return eqx.Partial(self, instance)


class _Config:
    """The `filter_jit` arguments, compared by value where they can be (so that two
    wrappers of one function share their traces, as in `eqx.filter_jit`)."""

    def __init__(self, donate, in_shardings, out_shardings, mesh, move_inputs):
        self.donate, self.in_shardings, self.out_shardings = donate, in_shardings, out_shardings
        self.mesh, self.move_inputs = mesh, move_inputs
        parts = (donate, in_shardings, out_shardings, mesh, move_inputs)
        leaves, treedef = jax.tree_util.tree_flatten(parts, is_leaf=_layouts.is_layout_leaf)
        self.key: Any = (treedef, tuple(leaves))
        try:
            hash(self.key)
        except TypeError:
            self.key = id(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Config) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


def _bind(wrapper: _JitWrapper, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if wrapper._signature is None:
        return args, kwargs
    bound = wrapper._signature.bind(*args, **kwargs)
    return bound.args, bound.kwargs


def _call(wrapper: _JitWrapper, args: tuple, kwargs: dict, *, lower: bool) -> Any:
    config: _Config = wrapper._config
    args, kwargs = _bind(wrapper, args, kwargs)
    fun = wrapper._fun
    fun_leaves = jax.tree_util.tree_leaves(fun)
    flat = Flat((fun, args, kwargs))
    static = (
        flat.treedef,
        tuple(_UNSET if a else x for x, a in zip(flat.leaves, flat.is_array, strict=True)),
    )
    key = hashable_key((config.key, static), flat)
    dynamic = [x for x, a in zip(flat.leaves, flat.is_array, strict=True) if a]
    signature = tuple(_signature_of(x) for x in dynamic)
    entry = _JITS.get((key, signature))
    if entry is None:
        entry = _build(wrapper, key, static, flat, fun_leaves, args, kwargs)
        _JITS[(key, signature)] = entry
    if entry.in_shardings:
        dynamic = _lay_out(config, flat, entry.in_shardings)
    if lower:
        return Lowered(entry.jitted.lower(*dynamic), wrapper, entry)
    # Equinox finds the user's frames for `eqx.error_if` messages by this local's name.
    __equinox_jit_id__ = os.urandom(16)
    try:
        with warnings.catch_warnings():
            if entry.suppress:
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            out = entry.jitted(*dynamic)
        # As `eqx.filter_jit`: wait for the result, so a runtime error is raised here.
        # (Only JAX arrays: a float0 output is a NumPy-like array with nothing to wait on.)
        first = next((x for x in out[0] if isinstance(x, jax.Array) and not is_tracer(x)), None)
        if first is not None:
            first.block_until_ready()
    except (jax.errors.JaxRuntimeError, ValueError) as e:
        error = equinox_runtime_error(e, __equinox_jit_id__)
        if error is None:
            raise
        raise error from None
    return _output(out)


def _signature_of(x: Any) -> Any:
    return (getattr(x, "shape", None), getattr(x, "dtype", None), getattr(x, "weak_type", None))


def _lay_out(config: _Config, flat: Flat, shardings: dict[int, Any]) -> list[Any]:
    """The call's array leaves, laid out as `in_shardings` asks (or checked to be)."""
    if config.move_inputs:
        moved = _layouts.move_inputs(flat, shardings)
    else:
        _layouts.check_inputs(flat, shardings)
        moved = {}
    return [moved.get(i, x) for i, x in enumerate(flat.leaves) if flat.is_array[i]]


def _build(
    wrapper: _JitWrapper, key: Any, static: tuple, flat: Flat, fun_leaves: list, args, kwargs
) -> _Entry:
    config: _Config = wrapper._config
    name = _names(wrapper._fun)
    fun = _traced_fun(key, static, name)
    flags = sum(_donate.donated(config.donate, fun_leaves, args, kwargs), [])
    arrays = flat.array_indices
    donate_argnums = tuple(n for n, i in enumerate(arrays) if flags[i])
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
    jit_in = tuple(in_shardings.get(i) for i in arrays) if in_shardings else None
    kw: dict[str, Any] = {"donate_argnums": donate_argnums}
    if jit_in is not None:
        kw["in_shardings"] = jit_in
    if config.out_shardings is not None:
        dynamic = [x for x, a in zip(flat.leaves, flat.is_array, strict=True) if a]
        if in_shardings:
            dynamic = _lay_out(config, flat, in_shardings)
        traced = jax.jit(fun, **kw).trace(*dynamic)
        abstract = _output(traced.out_info)
        found = _layouts.resolve_layouts(
            abstract, config.out_shardings, mesh=config.mesh, argname="out_shardings"
        )
        out_flat = Flat(abstract, is_array=is_array_like)
        kw["out_shardings"] = ([found.get(i) for i in out_flat.array_indices], None)
    return _Entry(jax.jit(fun, **kw), in_shardings, _donate.suppress_warning(config.donate))


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


def _names(fun: Any) -> tuple[str, str]:
    while True:
        if hasattr(fun, "__wrapped__"):
            fun = fun.__wrapped__
        elif isinstance(fun, ft.partial):
            fun = fun.func
        else:
            break
    try:
        return fun.__name__, fun.__qualname__
    except AttributeError:
        return type(fun).__name__, type(fun).__qualname__


class Lowered:
    """A lowered `filter_jit` call: `as_text()`, `compile()`, and `lowered` (JAX's)."""

    def __init__(self, lowered: Any, wrapper: _JitWrapper, entry: _Entry):
        self.lowered, self._wrapper, self._entry = lowered, wrapper, entry

    def as_text(self, *args: Any, **kwargs: Any) -> str:
        return self.lowered.as_text(*args, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> Compiled:
        return Compiled(self.lowered.compile(*args, **kwargs), self._wrapper, self._entry)


class Compiled:
    """A compiled `filter_jit` call: call it with the arguments `lower` was given (arrays
    of the same shapes); `compiled` is JAX's (`memory_analysis()`, `as_text()`)."""

    def __init__(self, compiled: Any, wrapper: _JitWrapper, entry: _Entry):
        self.compiled, self._wrapper, self._entry = compiled, wrapper, entry

    def as_text(self) -> str:
        return self.compiled.as_text()

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _bind(self._wrapper, args, kwargs)
        flat = Flat((self._wrapper._fun, args, kwargs))
        if self._entry.in_shardings:  # laid out as for a call
            dynamic = _lay_out(self._wrapper._config, flat, self._entry.in_shardings)
        else:
            dynamic = [x for x, a in zip(flat.leaves, flat.is_array, strict=True) if a]
        return _output(self.compiled(*dynamic))
