"""Pushing the standard basis of a PyTree's array leaves through a linear map, a chunk of
basis vectors at a time: the loop behind `filter_jacfwd`/`filter_jacrev`."""

from __future__ import annotations

import functools as ft
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import _compat
from .._placement import place


def one_hots(tree: Any, i: Any) -> Any:
    """The `i`-th standard basis vector of the space of `tree`'s array leaves, as a tree."""
    leaves, treedef = jtu.tree_flatten(tree)
    out, offset = [], 0
    for x in leaves:
        size = math.prod(x.shape)
        hot = jnp.arange(size) == i - offset
        out.append(hot.astype(x.dtype).reshape(x.shape))
        offset += size
    return jtu.tree_unflatten(treedef, out)


def pushed(
    one: Callable,
    shapes: list[tuple[int, ...]],
    batch_size: int | None,
    rev: bool,
    split: NamedSharding | None,
    devices: int,
) -> list[Any]:
    """`one(i)` for every basis index `i` (the basis leaves of `shapes`, flattened one after
    the other), `batch_size` at a time; for each basis leaf, a tree of its Jacobian blocks,
    the basis leaf's shape first (reverse mode) or last (forward mode, Equinox's layout).

    Each chunk is written in place (`dynamic_update_slice`) into a buffer carried through
    one `lax.fori_loop`, not stacked by a `lax.scan`: under `vmap` a scan stacks its chunks
    as `(chunks, batch, k, ...)` and moving the batch first copies the whole Jacobian once
    more, while the carried buffer keeps the batch axis first.

    With `split`, each basis leaf is cut along its first dimension that `devices` divides,
    device `c` owning the `c`-th block of it, so each leaf's Jacobian comes out split along
    that dimension with no data moved (a leaf with no such dimension is cut flat, padded
    with zero vectors, index -1, and may need collectives to be laid out). The buffer's
    basis axes are `(devices, m)`, split on the first; each step takes
    `batch_size // devices` of every device's `m` slots.
    """
    d = devices
    owners, folds = [], []  # per leaf: (d, p) basis indices; `(d, p, ...) -> shape + ...`
    offset = 0
    for shape in shapes:
        z = math.prod(shape)
        a = next((i for i, n in enumerate(shape) if n % d == 0), None)
        if a is None or d == 1:
            p = -(-z // d)
            owner = np.full(d * p, -1, np.int64)
            owner[:z] = offset + np.arange(z)
            owners.append(owner.reshape(d, p))
            folds.append((None, z, shape))
        else:
            cut = (*shape[:a], d, shape[a] // d, *shape[a + 1 :])
            index = offset + np.arange(z).reshape(cut)
            owners.append(np.moveaxis(index, a, 0).reshape(d, z // d))
            folds.append((a, z, shape))
        offset += z
    table = np.concatenate(owners, axis=1) if owners else np.zeros((d, 0), np.int64)
    table = table.astype(np.int32)
    m = table.shape[1]
    b = m if batch_size is None else max(1, min(batch_size, d * m) // d)
    steps, rem = divmod(m, b) if m else (0, 0)
    lead = 0 if rev else -2  # where the `(d, m)` basis axes sit in the buffer

    def constrain(x: Any, axis: int) -> Any:  # split axis `axis` (the device one) over `split`
        if split is None:
            return x
        spec = [None] * x.ndim
        spec[axis] = split.spec[0]
        return jax.lax.with_sharding_constraint(x, NamedSharding(split.mesh, P(*spec)))

    def rows(start: Any, size: int) -> Any:  # slots `[start, start+size)` of every device
        index = jax.lax.dynamic_slice_in_dim(jnp.asarray(table), start, size, axis=1)
        out = jax.vmap(jax.vmap(one))(constrain(index, 0))  # leaves `(d, size, *leaf)`
        if not rev:
            out = jtu.tree_map(lambda r: jnp.moveaxis(r, (0, 1), (-2, -1)), out)
        return jtu.tree_map(lambda r: constrain(r, lead % r.ndim), out)

    def write(buffer: Any, start: Any, size: int) -> Any:
        def put(buf: Any, r: Any) -> Any:
            at = [0] * buf.ndim
            at[lead % buf.ndim + 1] = start
            return jax.lax.dynamic_update_slice(buf, r, at)

        return jtu.tree_map(put, buffer, rows(start, size))

    def empty(s: Any) -> Any:
        shape = (d, m, *s.shape) if rev else (*s.shape, d, m)
        buffer = jnp.zeros(shape, s.dtype)
        # An output laid out on Explicit axes (a traced leaf's type says so)
        sharding = _compat.traced_sharding(s) if _compat.is_tracer(s) else None
        if isinstance(sharding, NamedSharding) and any(e is not None for e in sharding.spec):
            # The chunks written into the buffer carry that layout in their type; the
            # buffer must too (`dynamic_update_slice` takes no other).
            spec = [*sharding.spec, *[None] * (len(s.shape) - len(sharding.spec))]
            spec = [None, None, *spec] if rev else [*spec, None, None]
            buffer = place.relayout(buffer, NamedSharding(sharding.mesh, P(*spec)))
        return constrain(buffer, lead % len(shape))

    # One basis vector traced for its output's type (XLA drops the unused work).
    buffer = jtu.tree_map(empty, one(0))
    if steps:
        buffer = jax.lax.fori_loop(0, steps, lambda j, buf: write(buf, j * b, b), buffer)
    if rem:
        buffer = write(buffer, steps * b, rem)

    def block(fold: tuple, slot: int, p: int, r: Any) -> Any:
        """One basis leaf's slots `[slot, slot+p)` of every device, as its Jacobian block."""
        a, z, shape = fold
        at = 0 if rev else r.ndim - 2  # where the `(d, m)` basis axes are
        if (slot, p) != (0, m):
            r = jax.lax.slice_in_dim(r, slot, slot + p, axis=at + 1)
        before, after = r.shape[:at], r.shape[at + 2 :]
        if a is None:
            r = constrain(r.reshape(*before, d * p, *after), at)
            if d * p != z:
                r = jax.lax.slice_in_dim(r, 0, z, axis=at)
            return r.reshape(*before, *shape, *after)
        # `(d, *shape[:a], shape[a] // d, ...)` at `at`: put `d` back in front of its block
        r = r.reshape(*before, d, *shape[:a], shape[a] // d, *shape[a + 1 :], *after)
        r = jnp.moveaxis(r, at, at + a).reshape(*before, *shape, *after)
        return constrain(r, at + a)

    pieces, slot = [], 0
    for fold, owner in zip(folds, owners, strict=True):
        p = owner.shape[1]
        pieces.append(jtu.tree_map(ft.partial(block, fold, slot, p), buffer))
        slot += p
    return pieces
