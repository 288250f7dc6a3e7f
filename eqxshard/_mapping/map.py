"""`filter_map`: `eqx.filter_vmap` run in chunks inside one `lax.scan`."""

from __future__ import annotations

import dataclasses
import functools as ft
from collections.abc import Callable, Hashable
from typing import Any, overload

import equinox as eqx

from .._placement import committed
from .._tree import Flat, Params, T
from .axis_name import check_axis_name_size
from .budget import AutoBatchSize, check_memory_budget
from .chunks import (
    IF_ARRAY_0,
    check_batch_size,
    named_in_axes,
)
from .map_scan import rows_and_shards, run_chunks


@overload
def filter_map(
    fun: None = None,
    *,
    batch_size: int | str | None = None,
    in_axes: Any = IF_ARRAY_0,
    out_axes: Any = IF_ARRAY_0,
    axis_name: Hashable = None,
    axis_size: int | None = None,
    remat: bool = False,
    memory_budget: int | float | None = None,
) -> Callable[[Callable[Params, T]], Callable[Params, T]]: ...


@overload
def filter_map(
    fun: Callable[Params, T],
    *,
    batch_size: int | str | None = None,
    in_axes: Any = IF_ARRAY_0,
    out_axes: Any = IF_ARRAY_0,
    axis_name: Hashable = None,
    axis_size: int | None = None,
    remat: bool = False,
    memory_budget: int | float | None = None,
) -> Callable[Params, T]: ...


def filter_map(
    fun: Callable[..., Any] | None = None,
    *,
    batch_size: int | str | None = None,
    in_axes: Any = IF_ARRAY_0,
    out_axes: Any = IF_ARRAY_0,
    axis_name: Hashable = None,
    axis_size: int | None = None,
    remat: bool = False,
    memory_budget: int | float | None = None,
) -> Any:
    """Maps `fun` like `eqx.filter_vmap`, but `batch_size` rows at a time inside one
    `jax.lax.scan`, so the memory of the temporaries is that of one chunk.

    Results equal `eqx.filter_vmap(fun, in_axes=in_axes, out_axes=out_axes, axis_name=...,
    axis_size=...)(*args)`.
    Works eagerly, under `jax.jit`, and under `jax.grad`/`jax.jacfwd`/`jax.jacrev`/`vmap`.
    Non-array leaves are passed through untouched.

    Full chunks run in the `scan`; the `n % batch_size` rows left over run in one more
    call of the vmapped `fun` (no padding, so `fun` is traced twice when there is a
    remainder).

    **Sharded inputs.** When a mapped input is sharded along its mapped axis over `d`
    devices, each device keeps its own rows: every chunk takes `batch_size // d`
    consecutive rows from each device's block, so there is no all-gather and the output
    keeps the input's sharding on the mapped axis. `batch_size` is therefore the number of
    rows per chunk across the whole mesh; if it is not a multiple of `d` it is rounded
    down to one (at least `d`), with a warning. The layout is read from the arrays
    outside `jit` and from the types inside `jit`; inside `jit` on **Auto** mesh axes the
    layout is not visible, so the mapped axis is assumed split over all Auto axes of the
    mesh (a transpose of the inputs and outputs when it is not).

    **Arguments:**

    - `fun`: the function to map, called as `fun(*args)` (no keyword arguments). Leave
        it out to use `filter_map(...)` as a decorator.
    - `batch_size`: rows per chunk:
        - `None`: one row at a time (one per device when the mapped axis is sharded);
        - an int `>= 1`: any mapped size works, including `0`, fewer rows than
            `batch_size`, and a remainder;
        - `"auto"`: the largest chunk whose compiled temporaries (per device, from
            `compiled.memory_analysis()`) fit `memory_budget`; searched once per input
            shapes (a few compilations), then cached.
    - `in_axes`: which axis of each input to map over, as for `eqx.filter_vmap`: a prefix
        PyTree of the arguments tuple, or a dict keyed by argument name (`dict(y=1)`;
        the arguments it does not name get `eqx.if_array(0)`), with
        - an int: map over that axis (negative ints count from the end);
        - `None`: broadcast (non-arrays must use it);
        - a callable `leaf -> int | None`, e.g. the default `eqx.if_array(0)`.
    - `out_axes`: where the mapped axis goes in each output, a prefix PyTree of the
        output with the same three forms. `None` outputs must not depend on the mapped
        rows. A Python or NumPy scalar output given an int is broadcast along the mapped
        axis (as `jax.vmap` does).
    - `axis_name`: a hashable name for the mapped axis, for collectives (`jax.lax.psum`,
        `jax.lax.axis_index`, ...) inside `fun`. A collective over the mapped axis needs
        all rows in one `vmap`, so it is only allowed when the map runs in one chunk
        (`batch_size >= n`); in chunks it raises rather than reduce over one chunk.
        Giving an `axis_name` to a `fun` that uses no collective over it is always fine.
    - `axis_size`: the size of the mapped axis. Only needed when no input is mapped
        (then `fun` is vmapped over `axis_size` copies, as by `eqx.filter_vmap`);
        otherwise it must equal the mapped inputs' size.
    - `remat`: if `True`, wrap each chunk in `jax.checkpoint`, so the backward pass keeps
        only the chunk inputs and recomputes the rest: its temporaries are bounded by
        the chunk too, for about one more forward pass of compute.
    - `memory_budget`: bytes per device for `batch_size="auto"`:
        - `None`: half of the device memory that `device.memory_stats()` reports (CPU
            reports none: pass a number there);
        - a finite number of bytes `> 0`.
        Under `jax.vmap` the budget is for the whole batch: the search measures the
        vmapped program (of the innermost `vmap`, when they are nested).

    **Returns:**

    The mapped function (or, with `fun` left out, a decorator that makes it). Like
    `eqx.filter_vmap`'s, it is a Module whose leaves are those of `fun`: a mapped Module
    stored in another Module is trained with it.

    **Raises:**

    - `TypeError`: if `fun` is not callable; if `batch_size` is not `None`, an int or
        `"auto"`; if `memory_budget` is not a number; if `in_axes`/`out_axes` hold
        something else than `None`, ints and callables; if `in_axes` is a dict and `fun`'s
        signature cannot be read; if a non-array leaf is mapped; if `axis_name` is not
        hashable, `axis_size` not an int or `remat` not a bool; if an array leaf has a dtype
        JAX has no arrays of (strings, objects); if keyword arguments are passed to the
        mapped function.
    - `ValueError`: if `batch_size <= 0`; if `memory_budget` is not a finite number > 0,
        or is given without `batch_size="auto"`; with `"auto"`, if no budget is known or
        one row per shard does not fit it; if `in_axes`/`out_axes` is not a prefix of the
        arguments/output, or a dict `in_axes` names no argument; if an axis is out of
        range, listing every such leaf; if mapped leaves have different sizes, listing
        every mapped leaf; if `axis_size` is negative or differs from that size; if
        `out_axes` is `None` for outputs that vary with the rows, naming each; if `fun`
        uses a collective over `axis_name` and the map runs in more than one chunk; if
        `fun`'s non-array outputs differ between the full chunks and the remainder; if
        array arguments are committed to different devices (as `eqx.filter_vmap`, which
        JAX refuses), naming each.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import eqxshard

        model = eqx.nn.MLP(2, 1, 32, 2, key=jax.random.key(0))
        grid = jnp.stack(jnp.meshgrid(jnp.linspace(-1, 1, 50), jnp.linspace(-1, 1, 50)), -1)

        @eqxshard.filter_map(batch_size=256, in_axes=(None, 0))
        def evaluate(model, x):
            return model(x)

        values = evaluate(model, grid.reshape(-1, 2))  # shape (2500, 1)

        # `in_axes` keyed by argument name; a collective over the mapped axis needs the
        # whole axis in one chunk (here 2500 rows, as under `eqx.filter_vmap`).
        centred = eqxshard.filter_map(
            lambda model, x: model(x) - jax.lax.pmean(model(x), "rows"),
            batch_size=2500,
            in_axes=dict(model=None),
            axis_name="rows",
        )(model, grid.reshape(-1, 2))
        ```
    """
    check_batch_size(batch_size, "filter_map", allow_auto=True)
    check_memory_budget(memory_budget, batch_size, "filter_map")
    check_axis_name_size(axis_name, axis_size, "filter_map")
    if not isinstance(remat, bool):
        raise TypeError(f"`filter_map(remat=...)` must be a bool, got {type(remat).__name__}.")
    if fun is None:
        return ft.partial(
            filter_map,
            batch_size=batch_size,
            in_axes=in_axes,
            out_axes=out_axes,
            axis_name=axis_name,
            axis_size=axis_size,
            remat=remat,
            memory_budget=memory_budget,
        )
    auto = AutoBatchSize("filter_map", memory_budget) if batch_size == "auto" else None
    if not callable(fun):
        raise TypeError(f"`filter_map(fun)` must be callable, got {type(fun).__name__}.")

    return eqx.module_update_wrapper(
        _MapWrapper(fun, batch_size, in_axes, out_axes, axis_name, axis_size, remat, auto)
    )


class _MapWrapper(eqx.Module):
    """What `filter_map(fun)` returns: a PyTree (as `eqx.filter_vmap`'s wrapper is), so a
    mapped Module stored in another Module, or passed through `eqx.filter_jit`, keeps its
    arrays as leaves that are traced and differentiated rather than baked in."""

    _fun: Callable
    _batch_size: int | str | None
    _in_axes: Any
    _out_axes: Any
    _axis_name: Hashable
    _axis_size: int | None
    _remat: bool
    _auto: AutoBatchSize | None

    @property
    def __wrapped__(self) -> Callable:
        return self._fun

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                f"a function wrapped by `filter_map` takes positional arguments only, got "
                f"keyword arguments {sorted(kwargs)}. Pass them positionally (and give them "
                "`in_axes=None` to broadcast them)."
            )
        # As `eqx.filter_vmap`, arrays committed to different devices are refused (by JAX);
        # here before any work, naming each of them.
        committed.check_one_device_set("filter_map", Flat(args), prefix="args")
        fun, in_axes, out_axes = self._fun, self._in_axes, self._out_axes
        options = (self._axis_name, self._axis_size, self._remat, "filter_map")
        if self._auto is None:
            assert not isinstance(self._batch_size, str)  # only "auto", checked above
            return run_chunks(fun, self._batch_size, in_axes, out_axes, *options, args)

        def run(k: int, a: tuple) -> Any:
            return run_chunks(fun, k, in_axes, out_axes, *options, a)

        named = named_in_axes(fun, in_axes, args, "filter_map")
        n, shards = rows_and_shards(args, named, "filter_map")
        return run(self._auto(run, args, n, shards), args)

    def __hash__(self) -> int:
        # `jax.jit(filter_map(...))` hashes the wrapper; a dict `in_axes`/`out_axes` is not
        # hashable (`eqx.filter_vmap`'s wrapper raises there), so fall back to identity.
        try:
            return hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
        except TypeError:
            return id(self)

    def __get__(self, instance: Any, owner: Any) -> Any:
        if instance is None:
            return self
        return eqx.Partial(self, instance)  # a method: `self` is the first argument
