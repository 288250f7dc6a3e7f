"""The checks of `context_attention`'s arguments, before anything is traced, and the
`Problem` record of shapes and options they hand to the verb."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from .. import _compat
from .._placement.targets import given_mesh

VERB = "context_attention"
STRATEGIES = ("ring", "all_gather", "all_to_all")


@dataclass(frozen=True)
class Problem:
    """What the checks found: leading (batch) dims, sequence lengths, heads, the context
    axis and its size, and the options."""

    lead: tuple[int, ...]
    t: int
    s: int
    heads: int
    key_heads: int
    axis: str
    size: int
    strategy: str
    causal: bool
    scale: float
    heads_axis: str | None = None
    heads_size: int = 1
    dropout_p: float = 0.0


def mesh_of(mesh: Any) -> Mesh | AbstractMesh:
    """`mesh`, or the mesh set by `jax.set_mesh`; inside an outer `shard_map` over it (a
    pipeline's stage), the abstract mesh JAX has in context there."""
    return _compat.nested_mesh(given_mesh(VERB, mesh))


def _shape(name: str, x: Any, ndim: int, dims: str) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
        raise TypeError(f"`{VERB}`'s `{name}` must be an array {dims}, got {type(x).__name__}.")
    if len(shape) < ndim:
        raise ValueError(
            f"`{VERB}`'s `{name}` must have shape {dims} (any leading batch dims), got "
            f"shape {tuple(shape)}. Give the sequence, heads and width dims."
        )
    return tuple(int(d) for d in shape)


def check(
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    segment_ids: Any,
    *,
    causal: Any,
    scale: Any,
    mesh: Mesh | AbstractMesh,
    axis: Any,
    strategy: Any,
    heads_axis: Any = None,
    dropout_p: Any = 0.0,
    dropout_key: Any = None,
) -> Problem:
    if strategy not in STRATEGIES:
        raise ValueError(
            f"`{VERB}(strategy=...)` must be one of {list(STRATEGIES)}, got {strategy!r}."
        )
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(
            f"`{VERB}(axis=...)` must name an axis of the mesh to split the sequence over; "
            f"got {axis!r} and the mesh has the axes {list(mesh.axis_names)}. Pass one of "
            f"them, or build the mesh with a {axis!r} axis."
        )
    q = _shape("query", query, 3, "(..., T, H, Dk)")
    k = _shape("key", key, 3, "(..., S, G, Dk)")
    v = _shape("value", value, 3, "(..., S, G, Dv)")
    lead, (t, heads, width) = q[:-3], q[-3:]
    _check_heads(q, k, v)
    if k[:-3] != lead or v[:-3] != lead:
        raise ValueError(
            f"`{VERB}` needs the same leading (batch) dims on `query`, `key` and `value`; "
            f"got shapes {q}, {k} and {v}. Broadcast them to one batch shape first."
        )
    del width
    s = k[-3]
    size = int(dict(mesh.shape)[axis])
    heads_size = _check_heads_axis(heads_axis, mesh, axis, heads, k[-2])
    _check_lengths(t, s, heads // heads_size, k[-2], axis, size, strategy, causal)
    dropout_p = _check_dropout(dropout_p, dropout_key)
    if mask is not None:
        _check_side("mask", mask, lead, (t, s), "(..., T, S)", jnp.bool_, "a boolean")
    if segment_ids is not None:
        if t != s:
            raise ValueError(
                f"`{VERB}(segment_ids=...)` are shared by queries and keys, so the query "
                f"and key sequences must be as long; got T={t} and S={s}. Pass a `mask` "
                "of shape (..., T, S) instead."
            )
        _check_side("segment_ids", segment_ids, lead, (t,), "(..., T)", jnp.integer, "an integer")
    if not isinstance(causal, bool | np.bool_):
        raise TypeError(f"`{VERB}(causal=...)` must be a bool, got {causal!r}.")
    if scale is None:
        scale = 1.0 / math.sqrt(q[-1])
    elif isinstance(scale, bool) or not isinstance(scale, int | float | np.number):
        raise TypeError(
            f"`{VERB}(scale=...)` must be a Python number (or `None` for 1/sqrt(Dk)), got "
            f"{type(scale).__name__}."
        )
    return Problem(
        lead,
        t,
        s,
        heads,
        k[-2],
        axis,
        size,
        strategy,
        bool(causal),
        float(scale),
        heads_axis,
        heads_size,
        dropout_p,
    )


def check_manual_heads(heads_axis: Any, manual: frozenset[str], axis: str) -> None:
    """Inside a `shard_map` Manual over `axis`, a `heads_axis` must be Manual there too
    (each device then holds its heads)."""
    if heads_axis is not None and heads_axis not in manual:
        raise ValueError(
            f"`{VERB}` was called inside a `shard_map` over mesh axis {axis!r}, whose blocks "
            f"it attends where they are, with `heads_axis={heads_axis!r}`, which that "
            f"`shard_map` leaves to the compiler (its Manual axes: {sorted(manual)}). Map "
            f"the `shard_map` over {heads_axis!r} too (each device holding its heads), or "
            "pass `heads_axis=None`."
        )


def _check_heads_axis(
    heads_axis: Any, mesh: Mesh | AbstractMesh, axis: str, heads: int, key_heads: int
) -> int:
    """The size of `heads_axis` (1 for `None`), checked."""
    if heads_axis is None:
        return 1
    if not isinstance(heads_axis, str) or heads_axis not in mesh.axis_names or heads_axis == axis:
        raise ValueError(
            f"`{VERB}(heads_axis=...)` must name an axis of the mesh other than "
            f"`axis={axis!r}` to split the heads over, or be `None`; got {heads_axis!r} and "
            f"the mesh has the axes {list(mesh.axis_names)}."
        )
    size = int(dict(mesh.shape)[heads_axis])
    if heads % size or key_heads % size:
        raise ValueError(
            f"`{VERB}(heads_axis={heads_axis!r})` splits the heads over an axis of size "
            f"{size}, but `query` has {heads} heads and `key` {key_heads}: both must be "
            f"multiples of {size}. Pass `heads_axis=None` (the heads whole on each device), "
            "or use a head count the axis divides."
        )
    return size


def _check_dropout(dropout_p: Any, dropout_key: Any) -> float:
    """`dropout_p` as a float, checked with `dropout_key`."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, int | float | np.number):
        raise TypeError(
            f"`{VERB}(dropout_p=...)` must be a Python number in [0, 1], got "
            f"{type(dropout_p).__name__}."
        )
    if not 0 <= dropout_p <= 1:
        raise ValueError(f"`{VERB}(dropout_p=...)` must be in [0, 1], got {dropout_p}.")
    if dropout_p > 0 and dropout_key is None:
        raise ValueError(
            f"`{VERB}(dropout_p={dropout_p})` drops attention weights at random and needs "
            "`dropout_key` (a `jax.random.key`). Pass one, or `dropout_p=0`."
        )
    return float(dropout_p)


def _check_heads(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]) -> None:
    if k[-3] != v[-3] or k[-2] != v[-2]:
        raise ValueError(
            f"`{VERB}`'s `key` (..., S, G, Dk) and `value` (..., S, G, Dv) must agree on "
            f"S and G; got shapes {k} and {v}."
        )
    if q[-1] != k[-1]:
        raise ValueError(
            f"`{VERB}`'s `query` and `key` must have the same width Dk (last dim); got "
            f"shapes {q} and {k}."
        )
    if q[-2] % k[-2]:
        raise ValueError(
            f"`{VERB}`'s `query` has {q[-2]} heads and `key` has {k[-2]}: the query heads "
            "must be a multiple of the key heads (grouped-query attention). Give `key` and "
            "`value` a head count that divides the query's."
        )


def _check_lengths(
    t: int, s: int, heads: int, key_heads: int, axis: str, size: int, strategy: str, causal: Any
) -> None:
    for name, n in (("query", t), ("key", s)):
        if n % size:
            raise ValueError(
                f"`{VERB}` cannot split the sequence of `{name}` (length {n}) evenly over "
                f"mesh axis {axis!r} (size {size}). Pad the sequence to a multiple of "
                f"{size} (and mask the padding), or use a mesh axis whose size divides {n}."
            )
    if causal is True and t != s:
        raise ValueError(
            f"`{VERB}(causal=True)` needs queries and keys of the same length; got T={t} "
            f"and S={s}. Pass a `mask` of shape (..., T, S) that says which keys each "
            "query sees instead."
        )
    if causal is True and strategy == "ring" and t % (2 * size):
        raise ValueError(
            f"`{VERB}(causal=True, strategy='ring')` splits the sequence into {2 * size} "
            f"chunks (two per device on axis {axis!r}, for balanced work), but its length "
            f"{t} is not divisible by {2 * size}. Pad the sequence to a multiple of "
            f"{2 * size} (and mask the padding), or use `strategy='all_gather'`."
        )
    if strategy == "all_to_all" and heads % size:
        raise ValueError(
            f"`{VERB}(strategy='all_to_all')` splits the heads over mesh axis {axis!r} "
            f"(size {size}), but `query` has {heads} heads, not a multiple of {size}. Use "
            "`strategy='ring'` or `'all_gather'`, or a head count divisible by the axis."
        )
    del key_heads  # fewer key heads than devices: repeated (see `ulysses`)


def _check_side(
    name: str, x: Any, lead: tuple[int, ...], dims: tuple[int, ...], form: str, kind: Any, what: str
) -> None:
    shape = _shape(name, x, len(dims), form)
    if shape[len(shape) - len(dims) :] != dims or shape[: -len(dims)] not in ((), lead):
        want = (*lead, *dims)
        raise ValueError(
            f"`{VERB}(..., {name}=...)` must have shape {form} = {want} (or {dims}, the "
            f"same for every example), got {shape}."
        )
    if not jnp.issubdtype(x.dtype, kind):
        raise TypeError(f"`{VERB}(..., {name}=...)` must be {what} array, got dtype {x.dtype}.")
