"""Remembering how a placement call was resolved, so that the same call again is cheap.

`filter_shard` and `filter_put` turn `target`/`spec` into one sharding per array leaf
and check them (prefix trees, dtypes, axis names, ranks, divisibility). All of that is a
function of the call's *signature* alone:

- the tree's structure (its treedef, static fields included) and each leaf's type;
- each array leaf's shape and dtype;
- `target` and `spec` (by value; prefix trees by structure and leaves), the verb's
  options, and the meshes set by `jax.set_mesh` (which calls may read).

A call whose signature passed every check before is placed from its remembered plan:
a flatten, a few attribute reads per leaf, and the transfer of the leaves that are not
already laid out as asked. Any other call takes the full path, so every check that
catches a user error still runs on every signature not seen to pass.

Never remembered (always the full path): calls while a transformation traces (inside
`jit`, `vmap`, ...) or with traced leaves, with several processes, `process_local=True`,
callable specs and sharding rules (called on every leaf of every call, as documented),
and targets, specs or static fields that are not hashable.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Hashable
from operator import attrgetter
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec, Sharding

from .. import _compat
from .._caches import register
from . import place, staging, targets

# Call signatures kept (the least recently used goes first); shapes kept per signature.
MAX_PLANS = 64

# The leaves a call places, by the settled sharding each gets: (sharding, flat indices).
Moves = tuple[tuple[Sharding, tuple[int, ...]], ...]

_NOT_ARRAY, _ARRAY, _TRACED = 0, 1, 2
_shape = attrgetter("shape")
_dtype = attrgetter("dtype")


class Lookup(NamedTuple):
    """What `lookup` found: the keys to `store` under (`None`: never remembered), the
    flat indices of the array leaves, and the remembered moves (`None`: none yet)."""

    key: Hashable | None
    shapes: Hashable | None
    moves: Moves | None


NEVER = Lookup(None, None, None)

# The plans remembered, by call signature (see `lookup`), least recently used first.
PLANS: OrderedDict[Hashable, tuple[tuple[int, ...], dict[Hashable, Moves]]] = OrderedDict()
_jax_types: dict[type, bool] = {}  # whether a leaf type is a `jax.Array`
_kinds: dict[type, int] = {}  # what `eqx.is_array` says of a type, and whether it is traced
_counts = {"hits": 0, "misses": 0}


@register
def clear() -> None:
    """Forgets every remembered plan (and the static fields its treedefs hold) and what
    each leaf type is, and sets `counts` back to zero."""
    PLANS.clear()
    _jax_types.clear()
    _kinds.clear()
    _counts.update(hits=0, misses=0)


def counts() -> dict[str, int]:
    """Lookups that found a plan (`hits`) and that did not (`misses`) since `clear`."""
    return dict(_counts)


def _kind(t: type) -> int:
    kind = _kinds.get(t)
    if kind is None:
        if issubclass(t, _compat.Tracer):
            kind = _TRACED
        elif issubclass(t, (jax.Array, np.ndarray, np.generic)):  # `eqx.is_array`
            kind = _ARRAY
        else:
            kind = _NOT_ARRAY
        _kinds[t] = kind
    return kind


def _value_key(x: Any, is_leaf: Callable[[Any], bool]) -> Hashable:
    """`target` or `spec` as a hashable value; `TypeError` for what is never remembered."""
    if x is None or isinstance(x, (Sharding, jax.Device, str, Mesh, AbstractMesh)):
        return x
    if isinstance(x, PartitionSpec):  # P("a") == P(("a",)): each leaf keeps the form given
        return (PartitionSpec, _compat.spec_entries(x), x)
    if type(x) is object:  # the "not given" sentinel
        return x
    if getattr(x, "spec_for", None) is not None or (callable(x) and not isinstance(x, eqx.Module)):
        raise TypeError("rules and callable specs are called on every leaf of every call")
    leaves, treedef = jax.tree_util.tree_flatten(x, is_leaf=is_leaf)
    if len(leaves) == 1 and leaves[0] is x:  # not a tree and not a target or spec
        raise TypeError(f"{type(x).__name__} is read by the full path only")
    return (treedef, *(_value_key(v, is_leaf) for v in leaves))


def lookup(
    leaves: list[Any],
    treedef: Any,
    call: tuple[Any, ...],
    *,
    target: Any,
    spec: Any,
    target_leaf: Callable[[Any], bool],
    spec_leaf: Callable[[Any], bool],
) -> Lookup:
    """The moves remembered for this call, if any.

    `call` holds the verb's name and options; `target_leaf`/`spec_leaf` tell the leaves of
    a prefix `target`/`spec`.
    """
    if jax.process_count() > 1 or _compat.tracing():
        return NEVER
    types = tuple(map(type, leaves))
    try:
        key = (
            call,
            treedef,
            types,
            _value_key(target, target_leaf),
            _value_key(spec, spec_leaf),
            _compat.ambient_mesh(),
            _compat.context_abstract_mesh(),
        )
        found = PLANS.get(key)
    except Exception:  # unhashable or unusual targets, specs or static fields
        return NEVER
    if found is None:  # (a key found was stored with concrete leaves only: no check)
        if any(_kind(t) == _TRACED for t in set(types)):
            return NEVER
        indices = tuple(i for i, t in enumerate(types) if _kinds[t] == _ARRAY)
    else:
        with contextlib.suppress(KeyError):  # another thread may have dropped it since
            PLANS.move_to_end(key)
        indices = found[0]
    arrays = [leaves[i] for i in indices]
    shapes = (tuple(map(_shape, arrays)), tuple(map(_dtype, arrays)))
    moves = None if found is None else found[1].get(shapes)
    _counts["misses" if moves is None else "hits"] += 1
    return Lookup(key, (indices, shapes), moves)


MISSED = object()  # what `recall` gives for a call with no remembered moves


def recall(tree: Any, call: tuple[Any, ...], *, target: Any, spec: Any) -> tuple[Any, Lookup]:
    """`tree` placed by the moves remembered for this call of a placement verb (`MISSED`
    if there are none), and the lookup for `remember` to store under."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    found = lookup(
        leaves,
        treedef,
        call,
        target=target,
        spec=spec,
        target_leaf=targets.is_target_leaf,
        spec_leaf=targets.is_spec_leaf,
    )
    if found.moves is None:
        return MISSED, found
    return place_tree(tree, leaves, treedef, found.moves), found


def remember(found: Lookup, shardings: dict[int, Sharding]) -> None:
    """Stores the moves of a call resolved in full, where `recall` said it may be."""
    if found.key is not None and (moves := moves_of(shardings)) is not None:
        store(found, moves)


def store(found: Lookup, moves: Moves) -> None:
    """Remembers `moves` for the call `lookup` gave `found` for."""
    if found.key is None or found.shapes is None:
        return
    indices, shapes = found.shapes  # pyright: ignore[reportGeneralTypeIssues]
    entry = PLANS.get(found.key)
    if entry is None:
        entry = PLANS[found.key] = (indices, {})
        while len(PLANS) > MAX_PLANS:
            PLANS.popitem(last=False)
    if len(entry[1]) >= MAX_PLANS:  # many shapes for one structure: start over
        entry[1].clear()
    entry[1][shapes] = moves


def moves_of(shardings: dict[int, Sharding]) -> Moves | None:
    """What `place_tree` needs to place these leaves again; `None` where a call must take
    the full path every time (layouts over abstract meshes, devices of other processes)."""
    groups: dict[int, tuple[Sharding, list[int]]] = {}
    for i, sharding in shardings.items():
        if place.needs_constraint(None, sharding) or not sharding.is_fully_addressable:
            return None
        groups.setdefault(id(sharding), (place.settled(sharding), []))[1].append(i)
    return tuple((s, tuple(indices)) for s, indices in groups.values())


def place_tree(tree: Any, leaves: list[Any], treedef: Any, moves: Moves) -> Any:
    """`tree` placed by remembered moves: one batched transfer of the leaves not already
    laid out as asked, or the very same `tree` if none has to move."""
    indices: list[int] = []
    targets: list[Sharding] = []
    jax_types = _jax_types
    for sharding, group in moves:
        same = sharding  # a sharding object equal to `sharding`, as the placed leaves carry
        for i in group:
            x = leaves[i]
            t = type(x)
            is_jax = jax_types.get(t)
            if is_jax is None:  # (`isinstance(x, jax.Array)` is slow: a metaclass check)
                is_jax = jax_types[t] = issubclass(t, jax.Array)
            if is_jax and x.committed:
                current = x.sharding
                if current is same:
                    continue
                if current == sharding:
                    same = current
                    continue
                if place.already_placed(x, sharding):
                    continue
            indices.append(i)
            targets.append(sharding)
    if not indices:
        return tree
    out = list(leaves)
    moved = staging.device_put([leaves[i] for i in indices], targets)
    for i, y in zip(indices, moved, strict=True):
        out[i] = y
    return jax.tree_util.tree_unflatten(treedef, out)
