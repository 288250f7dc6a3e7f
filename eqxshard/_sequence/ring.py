"""The `"ring"` strategy: key/value blocks passed round the context axis by `ppermute`.

Each device keeps its queries and, over `C` steps, sees every key/value block once: it
folds the visiting block into an online softmax (running max, sum and weighted values in
float32) and passes the block on to the next device. A device holds a few blocks of keys
(its own, the visiting one, the one arriving), never the whole sequence's, and the
scores of one `T/C x S/C` block at a time, never a `T/C x S` row of blocks.

The backward pass (a `jax.custom_vjp`) goes round the ring again, FlashAttention's way:
the forward keeps only the queries, keys, values, output and each row's log-sum-exp;
each step recomputes one block's weights, adds to the local query gradient, and adds to
the key/value gradients that travel with their block (one last `ppermute` brings them
home). Without it JAX would keep every step's scores for the backward pass: `T/C x S`.

With `causal`, the blocks are in the zig-zag layout (see `zigzag`) and each step after the
first computes only its unmasked half, chosen by `lax.switch`: the same work on every
device.

With dropout, each block's factors are drawn from the key folded with the indices of its
query block (this device's) and its key block (the visiting one's home), for the whole
block (a step that computes half of it takes that half): the backward pass draws the
same ones again.
"""

from __future__ import annotations

import functools as ft
from typing import Any

import jax
import jax.numpy as jnp

from .blocks import F32, Across, Block, State, dropout_factors, finish, grads, start, update
from .zigzag import from_zigzag, positions, to_zigzag

# Which part of a step's queries x keys is computed (causal, zig-zag layout only).
_ALL, _EARLY_KEYS, _LATE_QUERIES = 0, 1, 2


def ring_attention(
    ring: Across, q: Any, k: Any, v: Any, mask: Any, seg: Any, key: Any = None
) -> Any:
    """A device's attention output `(B, Tq, G, R, Dv)` float32, from its plain blocks
    (`key`: where the dropout bits come from, a `Draw`; `None` without dropout)."""
    if not ring.causal:
        return _ring(ring, q, k, v, mask, seg, key)
    moved = [
        None if x is None else to_zigzag(x, axis=ring.axis, size=ring.size)
        for x in (q, k, v, mask, seg)
    ]
    out = _ring(ring, *moved, key)
    return from_zigzag(out, axis=ring.axis, size=ring.size)


def _part(case: Any, block: Block) -> tuple[slice, slice]:
    """The rows (queries) and columns (keys) a step computes."""
    every = slice(None)
    if case == _EARLY_KEYS:  # the visiting keys come before all of mine: their early half
        return every, slice(0, block.k.shape[1] // 2)
    if case == _LATE_QUERIES:  # they come after my early queries: my late half sees them
        return slice(block.q.shape[1] // 2, None), every
    return every, every


def _case(src: Any, me: Any) -> Any:
    """A step after the first (the visiting keys are another device's): 0 where they come
    before all of mine (`_EARLY_KEYS`), 1 where after my early queries (`_LATE_QUERIES`)."""
    return jnp.where(src < me, 0, 1)


def _block(ring: Across, me: Any, src: Any, q, k, v, mask, seg, kseg, key) -> Block:
    (b, tq, g, r, _), tk = q.shape, k.shape[1]
    qpos = positions(me, tq, size=ring.size, zigzag=ring.causal)
    kpos = positions(src, tk, size=ring.size, zigzag=ring.causal)
    cols = None if mask is None else jnp.take(mask, kpos, axis=2)
    drop = None
    if key is not None:
        drop = dropout_factors(key, ring.dropout, (b, g, r, tq, tk), me, src)
    return Block(q, qpos, seg, k, v, kpos, kseg, cols, drop)


def _each_case(ring: Across, step: Any, src: Any, me: Any, run: Any, *args: Any) -> Any:
    """`run(case, *args)` for this step's case: one call where it is known (not causal, or
    the first step: a device's own keys), else a `lax.switch`."""
    if not ring.causal or (isinstance(step, int) and step == 0):
        return run(_ALL, *args)
    cases = [ft.partial(run, c) for c in (_EARLY_KEYS, _LATE_QUERIES)]
    return jax.lax.switch(_case(src, me), cases, *args)


def _next(ring: Across, xs: Any) -> Any:
    perm = [(j, (j + 1) % ring.size) for j in range(ring.size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, ring.axis, perm), xs)


def _forward(ring: Across, q, k, v, mask, seg, key) -> tuple[Any, Any]:
    me = jax.lax.axis_index(ring.axis)
    b, tq, g, r, _ = q.shape

    def fold(step: Any, state: State, travel: tuple) -> State:
        src = (me - step) % ring.size
        k, v, kseg = travel
        block = _block(ring, me, src, q, k, v, mask, seg, kseg, key)

        def run(case: int, state: State) -> State:
            rows, cols = _part(case, block)
            part = block.part(rows, cols)
            new = update(_rows(state, rows), part, causal=ring.causal, scale=ring.scale)
            return _set_rows(state, rows, new)

        return _each_case(ring, step, src, me, run, state)

    def body(step: Any, carry: tuple) -> tuple:
        state, travel = carry
        travel = _next(ring, travel)
        return fold(step, state, travel), travel

    # The first step outside the loop: its state has the layout (a batch split over an
    # Explicit data axis) and the varying type over the axis that the loop carries.
    travel = (k, v, seg)
    state = fold(0, start(b, g, r, tq, v.shape[-1]), travel)
    state, _ = jax.lax.fori_loop(1, ring.size, body, (state, travel))
    return finish(state)


def _rows(state: State, rows: slice) -> State:
    return State(state.m[..., rows], state.l[..., rows], state.acc[:, :, :, rows])


def _set_rows(state: State, rows: slice, new: State) -> State:
    if rows == slice(None):
        return new
    return State(
        state.m.at[..., rows].set(new.m),
        state.l.at[..., rows].set(new.l),
        state.acc.at[:, :, :, rows].set(new.acc),
    )


@ft.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: Across, q, k, v, mask, seg, key) -> Any:
    return _forward(ring, q, k, v, mask, seg, key)[0]


def _ring_fwd(ring: Across, q, k, v, mask, seg, key) -> tuple[Any, tuple]:
    out, lse = _forward(ring, q, k, v, mask, seg, key)
    return out, (q, k, v, mask, seg, key, out, lse)


def _ring_bwd(ring: Across, res: tuple, dout: Any) -> tuple:
    q, k, v, mask, seg, key, out, lse = res
    me = jax.lax.axis_index(ring.axis)
    dout = jnp.moveaxis(dout.astype(F32), 1, 3)  # (B, G, R, Tq, Dv), as the row stats
    delta = jnp.sum(dout * jnp.moveaxis(out, 1, 3), axis=-1)

    def fold(step: Any, travel: tuple) -> tuple:
        """This step's gradients, each the shape of its whole block."""
        k, v, kseg = travel[:3]
        src = (me - step) % ring.size
        block = _block(ring, me, src, q, k, v, mask, seg, kseg, key)

        def run(case: int) -> tuple:
            rows, cols = _part(case, block)
            part = block.part(rows, cols)
            stats = (dout[:, :, :, rows], lse[..., rows], delta[..., rows])
            g = grads(part, *stats, causal=ring.causal, scale=ring.scale)
            return _whole(g.dq, rows), _whole(g.dk, cols), _whole(g.dv, cols)

        return _each_case(ring, step, src, me, run)

    def body(step: Any, carry: tuple) -> tuple:
        dq, travel = carry
        travel = _next(ring, travel)
        more = fold(step, travel)
        return dq + more[0], (*travel[:3], travel[3] + more[1], travel[4] + more[2])

    dq, dk, dv = fold(0, (k, v, seg))  # outside the loop, as in `_forward`
    dq, travel = jax.lax.fori_loop(1, ring.size, body, (dq, (k, v, seg, dk, dv)))
    dk, dv = _next(ring, travel[3:])  # home: the block each device started with
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


def _whole(x: Any, part: slice) -> Any:
    """A half block's gradient `x` (dim 1) in its place in the whole block, zeros beside."""
    if part == slice(None):
        return x
    halves = [jnp.zeros_like(x), x] if part.start else [x, jnp.zeros_like(x)]
    return jnp.concatenate(halves, axis=1)


_ring.defvjp(_ring_fwd, _ring_bwd)
