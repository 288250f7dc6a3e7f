"""The body of `filter_map`: how many rows and shards the mapped axis has, the rows
made scannable (strided when the axis is sharded, so no collectives), and one `lax.scan`
over the chunks with the remainder in a `vmap`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .._compat import axis_type_map, is_tracer, traced_sharding
from .._placement import place
from .._tree import pathstr
from .axis_name import check_no_collectives
from .chunks import (
    _Trace,
    _vmapped_body,
    check_mapped_leaves,
    named_in_axes,
    resolve_axes,
)
from .stream_host import check_dtypes


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
    traces: list[_Trace] = []
    body = _vmapped_body(fun, args_def, leaves, idx, out_axes, traces, name, axis_name)
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
    mapped_iter, unmapped_iter = iter(mapped_out), iter(unmapped_out)
    out_leaves = []
    for a, s in zip(first.axes, first.statics, strict=True):
        if a is not None:
            out_leaves.append(jnp.moveaxis(next(mapped_iter), 0, a))
        elif s is None:
            out_leaves.append(next(unmapped_iter))
        else:
            out_leaves.append(s)
    return jtu.tree_unflatten(first.treedef, out_leaves)
