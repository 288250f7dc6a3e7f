"""`filter_map`: `eqx.filter_vmap` run in chunks inside one `lax.scan`.

The verb and the wrapper it returns, then its body: how many rows and shards the mapped
axis has, the rows made scannable (strided when the axis is sharded, so no collectives),
and one `lax.scan` over the chunks with the remainder in a `vmap`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .._compat import axis_type_map, is_tracer, traced_sharding
from .._placement import committed, place
from .._tree import Flat, fun_optional, pathstr
from .axis_name import check_axis_name_size, check_no_collectives
from .budget import AutoBatchSize, check_memory_budget
from .chunks import (
    IF_ARRAY_0,
    Trace,
    check_batch_size,
    check_mapped_leaves,
    named_in_axes,
    resolve_axes,
    vmapped_body,
)
from .stream_host import check_dtypes


def _check_options(
    *,
    batch_size: Any,
    memory_budget: Any,
    axis_name: Any,
    axis_size: Any,
    remat: Any,
    **_: Any,
) -> None:
    """Checks `filter_map`'s options, with or without `fun`."""
    check_batch_size(batch_size, "filter_map", allow_auto=True)
    check_memory_budget(memory_budget, batch_size, "filter_map")
    check_axis_name_size(axis_name, axis_size, "filter_map")
    if not isinstance(remat, bool):
        raise TypeError(f"`filter_map(remat=...)` must be a bool, got {type(remat).__name__}.")


@fun_optional(check=_check_options, keeps_signature=True)
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


def _shard_count(leaf: Any, axis: int, n: int) -> int:
    """How many pieces the layout of `leaf` cuts its mapped axis into (1 if unknown)."""
    if n == 0:
        return 1
    if is_tracer(leaf):
        sharding = traced_sharding(leaf)
        if sharding is None or sharding.mesh.empty:
            return 1
        mesh_shape = dict(sharding.mesh.shape)
        spec = tuple(sharding.spec)
        entry = spec[axis] if axis < len(spec) else None
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        # Auto axes are not part of the type: assume the axis may be split over all of them.
        types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types, strict=True))
        auto = [a for a, t in types.items() if t == AxisType.Auto and a not in names]
        return math.prod(mesh_shape[a] for a in (*names, *auto))
    if isinstance(leaf, jax.Array):
        return n // leaf.sharding.shard_shape(leaf.shape)[axis]
    return 1


def _scannable(x: Any) -> Any:
    """`x` with its leading (chunk) dim not split over Explicit mesh axes, which `lax.scan`
    refuses. Only reached with one shard along the mapped axis (size-1 mesh axes, as on a
    one-device mesh), so no data moves."""
    sharding = traced_sharding(x) if is_tracer(x) else getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
        return x
    spec = tuple(sharding.spec)
    if not spec or spec[0] is None:
        return x
    types = axis_type_map(sharding.mesh)
    names = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
    if all(types[a] != AxisType.Explicit for a in names):
        return x
    return place.relayout(x, NamedSharding(sharding.mesh, P(None, *spec[1:])))


def rows_and_shards(args: tuple, in_axes: Any, name: str) -> tuple[int, int]:
    """The mapped size and how many shards split it (what `batch_size="auto"` searches)."""
    flat = jtu.tree_flatten_with_path(args)[0]
    leaves = [x for _, x in flat]
    ax = {i: a for i, a in enumerate(resolve_axes(args, in_axes, "in_axes", name)) if a is not None}
    if not ax:
        return 1, 1
    n = check_mapped_leaves([pathstr(p, "args") for p, _ in flat], leaves, ax, name)
    counts = [_shard_count(leaves[i], ax[i] % len(leaves[i].shape), n) for i in ax]
    return n, max([c for c in counts if c >= 1 and n % c == 0], default=1)


def run_chunks(
    fun: Callable,
    batch_size: int | None,
    in_axes: Any,
    out_axes: Any,
    axis_name: Any,
    axis_size: int | None,
    remat: bool,
    name: str,
    args: tuple,
) -> Any:
    flat, args_def = jtu.tree_flatten_with_path(args)
    paths = [pathstr(p, "args") for p, _ in flat]
    leaves = [x for _, x in flat]
    check_dtypes(name, paths, leaves)
    in_axes = named_in_axes(fun, in_axes, args, name)
    axes = resolve_axes(args, in_axes, "in_axes", name)
    ax = {i: a for i, a in enumerate(axes) if a is not None}
    idx = list(ax)
    if not idx:  # nothing to map over: exactly `filter_vmap`'s behaviour (and its errors)
        vmap = eqx.filter_vmap(
            fun, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name, axis_size=axis_size
        )
        return vmap(*args)
    n = check_mapped_leaves(paths, leaves, ax, name)
    if axis_size is not None and axis_size != n:
        raise ValueError(
            f"`{name}(axis_size={axis_size})` differs from the size {n} of the mapped axis of "
            "the inputs. Leave `axis_size` out (it is only needed when no input is mapped), or "
            "make them agree."
        )
    mapped = [jnp.moveaxis(jnp.asarray(leaves[i]), ax[i], 0) for i in idx]

    # Rows of a sharded mapped axis stay on their device: split it into `d` blocks, one per
    # shard, and take chunk `j` as rows `[j*b, (j+1)*b)` of every block (zero collectives).
    counts = [_shard_count(leaves[i], ax[i] % len(leaves[i].shape), n) for i in idx]
    d = max([c for c in counts if c >= 1 and n % c == 0], default=1)
    b = 1 if batch_size is None else max(1, batch_size // d)
    if batch_size is not None and batch_size % d:
        warnings.warn(
            f"`{name}(batch_size={batch_size})`: the mapped axis is split over {d} shards and "
            f"{batch_size} is not a multiple of {d}, so each chunk has {b} row(s) per shard "
            f"({b * d} rows). Pass a multiple of {d} to silence this.",
            stacklevel=3,
        )
    m = n // d
    num_chunks, rem = divmod(m, b)
    if axis_name is not None and num_chunks + (rem > 0) > 1:
        check_no_collectives(fun, args_def, leaves, idx, mapped, n, axis_name, batch_size, name)
    traces: list[Trace] = []
    body = vmapped_body(fun, args_def, leaves, idx, out_axes, traces, name, axis_name)
    chunk_body = jax.checkpoint(body, prevent_cse=False) if remat else body
    rest_body = jax.checkpoint(body) if remat else body

    def blocks(x: Any) -> Any:  # (n, ...) -> (d, m, ...)
        return x.reshape(d, m, *x.shape[1:])

    if num_chunks == 0:  # n <= one chunk: no loop at all
        mapped_out, unmapped_out = rest_body(mapped)
    else:
        if d == 1:
            xs = [
                _scannable(x[: num_chunks * b].reshape(num_chunks, b, *x.shape[1:])) for x in mapped
            ]
        else:
            xs = [
                blocks(x)[:, : num_chunks * b]
                .reshape(d, num_chunks, b, *x.shape[1:])
                .swapaxes(0, 1)
                for x in mapped
            ]

        def step(carry: None, chunk: list[Any]) -> tuple[None, Any]:
            chunk = [c.reshape(d * b, *c.shape[2:]) if d > 1 else c for c in chunk]
            mapped_out, unmapped_out = chunk_body(chunk)
            if d > 1:
                mapped_out = [y.reshape(d, b, *y.shape[1:]) for y in mapped_out]
            return carry, (mapped_out, unmapped_out)

        _, (ys, unmapped_out) = jax.lax.scan(step, None, xs)
        unmapped_out = [u[0] for u in unmapped_out]
        if d == 1:
            mapped_out = [y.reshape(num_chunks * b, *y.shape[2:]) for y in ys]
        else:
            mapped_out = [y.swapaxes(0, 1).reshape(d, num_chunks * b, *y.shape[3:]) for y in ys]
        if rem:
            if d == 1:
                rest = [x[num_chunks * b :] for x in mapped]
            else:
                rest = [
                    blocks(x)[:, num_chunks * b :].reshape(d * rem, *x.shape[1:]) for x in mapped
                ]
            rest_out, unmapped_out = rest_body(rest)
            if d == 1:
                mapped_out = [
                    jnp.concatenate([y, r]) for y, r in zip(mapped_out, rest_out, strict=True)
                ]
            else:
                mapped_out = [
                    jnp.concatenate([y, r.reshape(d, rem, *r.shape[1:])], axis=1)
                    for y, r in zip(mapped_out, rest_out, strict=True)
                ]
        if d > 1:
            mapped_out = [y.reshape(n, *y.shape[2:]) for y in mapped_out]

    first = traces[0]
    if not all(first.same_as(t) for t in traces[1:]):
        raise ValueError(
            f"`{name}` traced `fun` once for full chunks and once for the last, shorter chunk, "
            "and its non-array outputs (or output structure) differed between the two. "
            "Non-array outputs must be the same for every element: return them from outside "
            "the mapped function, or make them arrays."
        )
    return first.output(mapped_out, unmapped_out, jnp.moveaxis)
