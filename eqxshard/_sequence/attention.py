"""`context_attention`: attention with the sequence split over a mesh axis."""

from __future__ import annotations

import functools as ft
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec, Sharding

from .. import _compat
from .._caches import register
from .._placement import place
from .._tree import Flat
from . import checks
from .blocks import Across, Draw
from .gather import gather_attention
from .ring import ring_attention
from .ulysses import ulysses_attention


def _per_device(problem: checks.Problem) -> Any:
    """The strategy's per-device function on 5-dim queries `(B, Tq, G, R, Dk)`."""
    p = problem
    across = Across(p.axis, p.size, p.causal, p.scale, p.dropout_p)
    run = {"ring": ring_attention, "all_gather": gather_attention, "all_to_all": ulysses_attention}
    return ft.partial(run[p.strategy], across)


def _batched(x: Any, problem: checks.Problem, dims: int) -> Any:
    """`x` with its leading dims as one batch dim (broadcast where it has none)."""
    if x is None:
        return None
    batch = math.prod(problem.lead)
    if x.ndim == dims:  # a mask or segment ids shared by every example
        return jnp.broadcast_to(x, (batch, *x.shape))
    return jnp.reshape(x, (batch, *x.shape[x.ndim - dims :]))


@register
def _clear() -> None:
    _program.cache_clear()


def _device_function(problem: checks.Problem, mesh: Mesh | AbstractMesh, dtype: Any) -> Any:
    """`per_device(batch, q, k, v, mask, seg, key)`: one device's attention on its block
    of the sequence, `q` `(B, T/C, H, Dk)` (its heads with `heads_axis`), `batch` the
    Manual axes its examples are split over (major first)."""
    run = _per_device(problem)
    groups, heads = problem.key_heads // problem.heads_size, problem.heads_axis

    def per_device(batch: Any, q: Any, k: Any, v: Any, mask: Any, seg: Any, key: Any) -> Any:
        b, t, h, dk = q.shape
        draw = None
        if key is not None:  # this device's first example and head, by global index
            example = jnp.int32(0)
            for name in batch:  # the mapped batch axes, major first
                example = example * _size(mesh, name) + jax.lax.axis_index(name)
            first = jax.lax.axis_index(heads) * h if heads else 0
            draw = Draw(key, example * b, first)
        out = run(q.reshape(b, t, groups, h // groups, dk), k, v, mask, seg, draw)
        return out.reshape(b, t, h, out.shape[-1]).astype(dtype)

    return per_device


def _batched_args(problem: checks.Problem, *args: Any) -> tuple[Any, ...]:
    query, key, value, mask, segment_ids = args
    return (
        _batched(query, problem, 3),
        _batched(key, problem, 3),
        _batched(value, problem, 3),
        _batched(mask, problem, 2),
        _batched(segment_ids, problem, 1),
    )


@ft.lru_cache(maxsize=64)
def _program(problem: checks.Problem, mesh: Mesh | AbstractMesh, dtype: Any) -> Any:
    """The whole computation, jitted: called eagerly it runs as one program (a
    `jax.shard_map` called outside `jit` would run op by op); inside a `jit` it is inlined."""
    per_device = _device_function(problem, mesh, dtype)
    axis, heads = problem.axis, problem.heads_axis

    @jax.jit
    def program(query: Any, key: Any, value: Any, mask: Any, segment_ids: Any, drop: Any) -> Any:
        args = _batched_args(problem, query, key, value, mask, segment_ids)
        batch = _batch_axes(args[0], mesh, axis)
        split = PartitionSpec(batch[0] if len(batch) == 1 else batch or None, axis)
        # With `heads_axis`, queries, keys, values and the output have their heads split
        # over it too, each device attending its heads.
        split_heads = PartitionSpec(*split, heads) if heads else split
        specs = (split_heads, split_heads, split_heads, split, split)
        args = _laid_out(args, mesh, specs)
        mapped = (*batch, *([heads] if heads else []))
        # Nested in a pipeline's `shard_map` over its stage axis, its backward pass
        # recomputes the attention (`_compat.nested_shard_map` says why).
        body: Any = _compat.nested_shard_map(
            ft.partial(per_device, batch),
            mesh=mesh,
            in_specs=(
                *(None if x is None else spec for x, spec in zip(args, specs, strict=True)),
                None if drop is None else PartitionSpec(),
            ),
            out_specs=split_heads,
            axis_names=frozenset({axis, *mapped}),
        )
        out = body(*args, drop)
        return jnp.reshape(out, (*problem.lead, *out.shape[1:]))

    return program


def _in_manual(
    problem: checks.Problem, mesh: Mesh | AbstractMesh, dtype: Any, manual: frozenset[str]
) -> Any:
    """The computation called inside a `shard_map` already Manual over the context axis:
    the per-device function itself, on the blocks the caller holds (a `shard_map` nested
    over an axis already Manual is refused by JAX). The other Manual axes but the heads
    axis number the examples for dropout, as a batch split over them would."""
    per_device = _device_function(problem, mesh, dtype)
    skip = {problem.axis, problem.heads_axis}
    batch = tuple(n for n in mesh.axis_names if n in manual and n not in skip)

    def local(query: Any, key: Any, value: Any, mask: Any, segment_ids: Any, drop: Any) -> Any:
        args = _batched_args(problem, query, key, value, mask, segment_ids)
        out = per_device(batch, *args, drop)
        return jnp.reshape(out, (*problem.lead, *out.shape[1:]))

    return local


def _whole(x: Any, times: dict[int, int]) -> Any:
    """A stand-in with the shape of the whole of `x` (its dim `d`, counted from the end,
    `times[d]` times as long), for the checks that read whole shapes; `x` itself where it
    is not an array."""
    if x is None or not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return x
    shape = list(x.shape)
    for d, n in times.items():
        if len(shape) >= -d:
            shape[d] *= n
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)


def _size(mesh: Mesh | AbstractMesh, name: str) -> int:
    return int(dict(mesh.shape)[name])


def _batch_axes(query: Any, mesh: Mesh | AbstractMesh, axis: str) -> tuple[str, ...]:
    """The Explicit mesh axes (not `axis`) that split the query's batch dim (a data axis).

    They are mapped by the `jax.shard_map` too, each device then holding its examples:
    JAX 0.10 cannot transpose an `all_gather` whose operand is split over an Explicit axis
    left outside the map. Auto axes are left to the compiler, which keeps the batch split.
    """
    sharding = _compat.traced_sharding(query)
    entries = _compat.spec_entries(sharding.spec) if sharding is not None else ()
    first = entries[0] if entries else None
    names = () if first is None else first if isinstance(first, tuple) else (first,)
    types = _compat.axis_type_map(mesh)
    return tuple(n for n in names if n != axis and types.get(n) == AxisType.Explicit)


def _laid_out(args: tuple, mesh: Mesh | AbstractMesh, specs: tuple) -> tuple:
    """`args` laid out by `specs` where they name Explicit axes: `jax.shard_map` then takes
    only inputs already laid out so (on Auto axes it lays them out itself)."""
    types = _compat.axis_type_map(mesh)
    names = [
        n
        for spec in specs
        for entry in spec
        for n in ((entry,) if isinstance(entry, str) else entry or ())
    ]
    if all(types[n] != AxisType.Explicit for n in names):
        return args
    flat = Flat(args)
    shardings: dict[int, Sharding] = {}
    given = [spec for x, spec in zip(args, specs, strict=True) if x is not None]
    for index, spec in zip(flat.array_indices, given, strict=True):
        shardings[index] = NamedSharding(mesh, spec)
    return tuple(flat.rebuild(place.place(checks.VERB, flat, shardings)))


def context_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any = None,
    segment_ids: Any = None,
    causal: bool = False,
    scale: float | None = None,
    mesh: Mesh | AbstractMesh | None = None,
    axis: str = "context",
    strategy: str = "ring",
    heads_axis: str | None = None,
    dropout_p: float = 0.0,
    dropout_key: Any = None,
) -> jax.Array:
    """Dot-product attention with the sequence split over the mesh axis `axis` (context
    parallelism): `softmax(query key^T * scale, masked) value`, as one device computes it
    (up to float32 summation order), for sequences too long for one device.

    Works eagerly and inside `jax.jit` / `eqx.filter_jit`, with gradients with respect to
    `query`, `key` and `value`, and under `jax.vmap` (call it per example, as an Equinox
    model does). The sequence dim is laid out over `axis` (each device a contiguous block),
    and the output keeps that layout; other mesh axes (a data axis splitting the batch)
    stay as the inputs have them.

    Inside a `shard_map` (a pipeline's stage: `Stacked` with a stage axis, `filter_pipeline`)
    it works as elsewhere, gradients included; there its backward pass computes the
    attention's forward pass again (JAX cannot keep a nested `shard_map`'s residuals).
    Inside a `shard_map` already Manual over `axis` (`filter_shard_map` over `("data",
    "context")`), each device passes its own blocks (`query` `(..., T/C, H, Dk)`, `key`
    and `value` `(..., S/C, G, D)`, `mask` `(..., T/C, S)`, `segment_ids` `(..., T/C)`,
    block `i` of the sequence on device `i` of `axis`) and gets its block of the output:
    they are attended where they are, with no `shard_map` of this function's own; with
    `heads_axis`, that `shard_map` must be Manual over it too (each device its heads).

    Scores and the softmax are computed in float32 whatever the inputs' dtype. A query
    that may see no key at all (every key masked) gets the output 0 (and zero
    gradients), not NaN and not an average of the values.

    **Arguments:**

    - `query`: `(..., T, H, Dk)`: any leading batch dims (or none), `T` queries, `H` heads.
    - `key`: `(..., S, G, Dk)`, the same leading dims; `G` key heads, where `H` is a
        multiple of `G` (grouped-query attention: query head `h` uses key head
        `h // (H // G)`).
    - `value`: `(..., S, G, Dv)`.
    - `mask`: `None` (default), or a boolean `(..., T, S)` (or `(T, S)`, the same for
        every example): `True` where a query may see a key (padding masks and the like).
        Each device holds its queries' rows of it.
    - `segment_ids`: `None` (default), or integers `(..., T)` (or `(T,)`), shared by
        queries and keys (`T == S`): packed sequences, a query seeing only keys of its
        own segment.
    - `causal`: `True` for each query to see only keys at its position or before
        (`T == S`). Combines with `mask` and `segment_ids` (all must allow a pair).
    - `scale`: the factor on the scores, a Python number; `None` (default): `1/sqrt(Dk)`.
    - `mesh`: the mesh whose axis `axis` splits the sequence (Auto or Explicit axes).
        `None` (default): the mesh set by `jax.set_mesh`.
    - `axis`: the mesh axis name to split the sequence over. Default `"context"`.
    - `strategy`: how devices share keys and values:
        - `"ring"` (default): key/value blocks go round the axis by `ppermute`; each
            device folds each block into an online softmax, so it never holds more than
            two blocks of keys nor more than a `T/C x S/C` block of scores (`C` the
            axis size). Its backward pass goes round the ring again. With `causal`, the
            sequence is cut into `2C` chunks and device `i` works on chunks `i` and
            `2C-1-i` (moved there and back inside the function, so the caller's layout
            stays the plain split): every device then does the same work, and the
            masked half of every block is skipped.
        - `"all_gather"`: every device gathers all keys and values: the simplest, for
            short sequences; a `T/C x S` block of scores per device.
        - `"all_to_all"` (DeepSpeed-Ulysses): an all-to-all trades the sequence split
            for a head split, each device attends `H/C` heads over the whole sequence,
            and a second all-to-all trades back. `H` must be a multiple of `C`; where `G`
            is not, keys and values are first repeated to one per query head.
    - `heads_axis`: `None` (default), or another mesh axis that splits the heads (tensor
        parallelism beside the sequence split): queries, keys, values and the output are
        then laid out with their heads over it too, and each device attends its heads of
        its part of the sequence. `H` and `G` must be multiples of its size (and, with
        `"all_to_all"`, `H` over it a multiple of `C`).
    - `dropout_p`: the probability of dropping each attention weight (after the softmax,
        the kept ones scaled by `1/(1-dropout_p)`), a Python number in [0, 1]. Default 0.
        The weighted sum of the values is dropped, never the softmax's normaliser. The
        bits are drawn per block of queries x keys, example and head, from `dropout_key`
        folded with their indices (whichever devices hold the examples and heads): the
        same key gives the same output, but not the mask that attention computed whole
        would draw from it.
    - `dropout_key`: a `jax.random.key`, needed where `dropout_p > 0`; ignored otherwise.

    **Returns:**

    An array `(..., T, H, Dv)` of the promoted dtype of `query`, `key` and `value`, with
    its sequence dim split over `axis`.

    **Raises:**

    - `ValueError`: if no `mesh` is given and none is set; `axis` is not an axis of the
        mesh; `strategy` is unknown; `query`, `key`, `value` have other leading dims,
        widths (`Dk`), lengths or head counts that disagree (`H` not a multiple of `G`);
        `T` or `S` is not divisible by the size of `axis` (with `causal` and the ring:
        by twice the size); `causal` with `T != S`; `"all_to_all"` with `H` not divisible
        by the size of `axis`; `mask` or `segment_ids` of the wrong shape, or
        `segment_ids` with `T != S`; `heads_axis` is not another axis of the mesh, or
        does not divide the heads, or (inside a `shard_map` Manual over `axis`) is not
        Manual there too; `dropout_p` is outside [0, 1], or above 0 without a
        `dropout_key`.
    - `TypeError`: if `mesh` is not a mesh, an input is not an array, `mask` is not
        boolean, `segment_ids` are not integers, `causal` is not a bool, or `scale` or
        `dropout_p` is not a number.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import eqxshard

        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("context",), axis_types=auto)
        q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 64, 4, 8))  # (B, T, H, D)

        @jax.jit
        def loss(q, k, v):
            out = eqxshard.context_attention(q, k, v, causal=True, mesh=mesh)
            return jnp.sum(out**2)

        grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        ```
    """
    mesh = checks.mesh_of(mesh)
    manual = _compat.manual_axes_here()
    given = (query, key, value, mask, segment_ids)
    if isinstance(axis, str) and axis in manual:  # each device's blocks: check the whole
        checks.check_manual_heads(heads_axis, manual, axis)
        c = _size(mesh, axis)
        h = _size(mesh, heads_axis) if heads_axis is not None else 1
        sides = ({-3: c, -2: h}, {-3: c, -2: h}, {-3: c, -2: h}, {-2: c}, {-1: c})
        given = tuple(_whole(x, times) for x, times in zip(given, sides, strict=True))
    problem = checks.check(
        *given,
        causal=causal,
        scale=scale,
        mesh=mesh,
        axis=axis,
        strategy=strategy,
        heads_axis=heads_axis,
        dropout_p=dropout_p,
        dropout_key=dropout_key,
    )
    dtype = jnp.result_type(query, key, value)
    drop = dropout_key if problem.dropout_p > 0 else None
    if axis in manual:
        return _in_manual(problem, mesh, dtype, manual)(query, key, value, mask, segment_ids, drop)
    program = _program(problem, mesh, dtype)
    return program(query, key, value, mask, segment_ids, drop)
