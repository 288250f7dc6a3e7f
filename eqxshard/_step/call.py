"""How a `filter_jit` call runs: its cache, its `jax.jit`s, and what `lower` returns.

A call flattens `(fun, args, kwargs)` once: array leaves are traced, the rest (with the
tree structure) is held static and is the cache key, as in `eqx.filter_jit`. For each key
one Python function is traced, by one `jax.jit` that carries the resolved `in_shardings`,
`out_shardings` and `donate_argnums` over the array leaves in their flattening order: the
very program a hand-written `jax.jit` with those arguments compiles (`entry.py`).

Layouts depend on the inputs' shapes, so a configuration with `in_shardings`,
`out_shardings` or a `donate` filter resolves them once per input signature (each leaf's
abstract value); without them one entry serves every signature and JAX's own cache tells
signatures apart. A call like one seen before does no more than flatten, split the
leaves, look its entry up, check that laid-out inputs are still the very layouts last
found right (`entry.lay_out`), call the `jax.jit` and rebuild the output.
"""

from __future__ import annotations

import functools as ft
import inspect
import operator
import os
import warnings
from typing import Any

import equinox as eqx
import jax

from .._compat import equinox_runtime_error, is_tracer
from .._tree import Flat
from . import donate as _donate, layouts as _layouts, sharding_note as _sharding_note
from .entry import Entry, build, lay_out, output
from .leaves import Split
from .static import hashable_key

# Per static part of a call (with the configuration): its entry, or its entries by
# input signature.
_SITES: dict[Any, dict[Any, Any]] = {}


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
        # Layouts (and a `donate` filter) are resolved per input signature.
        self.per_signature = (
            in_shardings is not None
            or out_shardings is not None
            or (callable(donate) and not isinstance(donate, (str, eqx.Module)))
        )
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
    if wrapper._signature is not None:
        args, kwargs = _bind(wrapper, args, kwargs)
    try:
        entry, dynamic = entry_of(wrapper, args, kwargs)
        runs = entry.runs_of(dynamic)
        if lower:
            return Lowered(entry.jitted.lower(*runs), wrapper, entry)
        return output(run(entry, runs))
    except (RuntimeError, ValueError) as e:  # a deleted input: say which and why
        error = _donate.deleted_inputs(wrapper._fun, args, kwargs)
        if error is None:
            raise
        raise error from e


def run(entry: Entry, runs: list[list[Any]]) -> Any:
    """Calls the entry's `jax.jit` and waits for it, as `eqx.filter_jit` does, so that a
    runtime error (`eqx.error_if`) is raised here, with Equinox's message."""
    # Equinox finds the user's frames for `eqx.error_if` messages by this local's name.
    __equinox_jit_id__ = os.urandom(16)
    try:
        if entry.suppress:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                out = entry.jitted(*runs)
        else:
            out = entry.jitted(*runs)
        # (Only JAX arrays: a float0 output is a NumPy-like array with nothing to wait on.)
        first = next((x for x in out[0] if isinstance(x, jax.Array) and not is_tracer(x)), None)
        if first is not None:
            first.block_until_ready()
    except (jax.errors.JaxRuntimeError, ValueError) as e:
        error = equinox_runtime_error(e, __equinox_jit_id__)
        if error is None:
            raise
        raise error from None
    return out


_LAST: Any = object()  # a site's key for the avals of its last call, and their entry


def _lookup(site: dict, split: Split) -> tuple[Entry | None, Any, list | None]:
    """The entry for the call's input signature, the signature, and the avals to remember
    as the last call's. JAX shares the abstract value of arrays alike, so a call with the
    very avals of the last one is found by identity, without hashing them."""
    if split.host:
        signature = split.signature()
        return site.get(signature), signature, None
    avals = [x.aval for x in split.dynamic]
    last = site.get(_LAST)
    if last is not None and len(last[0]) == len(avals) and all(map(operator.is_, avals, last[0])):
        return last[1], None, None
    signature = tuple(avals)
    return site.get(signature), signature, avals


def entry_of(wrapper: _JitWrapper, args: tuple, kwargs: dict) -> tuple[Entry, list[Any]]:
    """The entry of this call (built on first sight) and its array leaves, laid out."""
    config: _Config = wrapper._config
    tree = (wrapper._fun, args, kwargs)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    split = Split(leaves)
    key = (config.key, treedef, split.static)
    flat = lambda: Flat.of_leaves(leaves, treedef, split.is_array)
    try:
        site = _SITES.get(key)
    except TypeError:
        hashable_key(key, flat())  # raises, naming the unhashable static leaves
        raise
    if site is None:
        site = _SITES[key] = {}
    entry, signature, avals = (
        _lookup(site, split) if config.per_signature else (site.get(None), None, None)
    )
    if entry is None:
        fun = wrapper._fun
        entry, dynamic = build(config, fun, key, flat(), args, kwargs, _names(fun))
        site[signature] = entry
        if avals is not None:
            site[_LAST] = (avals, entry)
        return entry, dynamic
    if avals is not None:
        site[_LAST] = (avals, entry)
    return entry, lay_out(entry, config, split.dynamic, split.traced, flat)


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

    def __init__(self, lowered: Any, wrapper: _JitWrapper, entry: Entry):
        self.lowered, self._wrapper, self._entry = lowered, wrapper, entry

    def as_text(self, *args: Any, **kwargs: Any) -> str:
        return self.lowered.as_text(*args, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> Compiled:
        return Compiled(self.lowered.compile(*args, **kwargs), self._wrapper, self._entry)


class Compiled:
    """A compiled `filter_jit` call: call it with the arguments `lower` was given (arrays
    of the same shapes); `compiled` is JAX's (`memory_analysis()`, `as_text()`)."""

    def __init__(self, compiled: Any, wrapper: _JitWrapper, entry: Entry):
        self.compiled, self._wrapper, self._entry = compiled, wrapper, entry

    def as_text(self) -> str:
        return self.compiled.as_text()

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _bind(self._wrapper, args, kwargs)
        tree = (self._wrapper._fun, args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        split = Split(leaves)
        flat = lambda: Flat.of_leaves(leaves, treedef, split.is_array)
        # Laid out as for a call.
        dynamic = lay_out(self._entry, self._wrapper._config, split.dynamic, split.traced, flat)
        return output(self.compiled(*self._entry.runs_of(dynamic)))
