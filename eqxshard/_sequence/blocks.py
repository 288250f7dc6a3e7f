"""One block of queries against one block of keys: the arithmetic every strategy shares.

Layouts, per device (`B` the flattened batch, `G` key heads, `R` query heads per key head):
queries `(B, Tq, G, R, Dk)`, keys `(B, Tk, G, Dk)`, values `(B, Tk, G, Dv)`; the online
softmax's running max `m` and sum `l` are `(B, G, R, Tq)` and its output sum `acc` is
`(B, G, R, Tq, Dv)`, all float32 whatever the inputs' dtype.

A query that may see no key (every key masked) gets the output 0 and zero gradients:
its sum `l` stays 0, and `finish` writes 0 there instead of 0/0.

Dropout on the attention weights (`Block.drop`) multiplies each weight by 0 or
`1/(1-p)` in the weighted sum of the values only: the softmax's normaliser is the sum of
the weights before dropout, as `softmax` then dropout computes it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32


class Across(NamedTuple):
    """How a strategy splits attention: over mesh `axis` of `size` devices, causal or
    not, the scores scaled by `scale`, each weight dropped with probability `dropout`."""

    axis: str
    size: int
    causal: bool
    scale: float
    dropout: float = 0.0


class Block(NamedTuple):
    """The queries and keys of one block, with what decides which pairs may meet:
    positions (for `causal`), segment ids (`None`: one segment) and the caller's boolean
    mask rows x columns (`None`: every pair)."""

    q: Any
    qpos: Any
    qseg: Any
    k: Any
    v: Any
    kpos: Any
    kseg: Any
    mask: Any
    drop: Any = None  # `(B, G, R, Tq, Tk)`: each weight's dropout factor (`None`: no dropout)

    def part(self, rows: slice, cols: slice) -> Block:
        """The queries `rows` against the keys `cols` (static slices)."""
        return Block(
            self.q[:, rows],
            self.qpos[rows],
            None if self.qseg is None else self.qseg[:, rows],
            self.k[:, cols],
            self.v[:, cols],
            self.kpos[cols],
            None if self.kseg is None else self.kseg[:, cols],
            None if self.mask is None else self.mask[:, rows, cols],
            None if self.drop is None else self.drop[:, :, :, rows, cols],
        )

    def valid(self, causal: bool) -> Any:
        """Which query may see which key, `(B or 1, 1, 1, Tq, Tk)`; `None`: all of them."""
        parts = []
        if causal:
            parts.append((self.qpos[:, None] >= self.kpos[None, :])[None])
        if self.qseg is not None:
            parts.append(self.qseg[:, :, None] == self.kseg[:, None, :])
        if self.mask is not None:
            parts.append(self.mask)
        if not parts:
            return None
        valid = parts[0]
        for p in parts[1:]:
            valid = valid & p
        return valid[:, None, None]


class State(NamedTuple):
    """The online softmax so far: running max `m`, sum `l` and weighted values `acc`."""

    m: Any
    l: Any  # noqa: E741
    acc: Any


def start(b: int, g: int, r: int, tq: int, dv: int) -> State:
    return State(
        jnp.full((b, g, r, tq), -jnp.inf, F32),
        jnp.zeros((b, g, r, tq), F32),
        jnp.zeros((b, g, r, tq, dv), F32),
    )


def scores(q: Any, k: Any, scale: float) -> Any:
    """`q k^T * scale` per head, `(B, G, R, Tq, Tk)`, summed in float32."""
    return jnp.einsum("bqgrd,bkgd->bgrqk", q, k, preferred_element_type=F32) * scale


def update(state: State, block: Block, *, causal: bool, scale: float) -> State:
    """`state` after the keys of `block`. The running max only steadies the exponentials
    (the output does not depend on it), so no gradient flows through it."""
    s = scores(block.q, block.k, scale)
    valid = block.valid(causal)
    if valid is not None:
        s = jnp.where(valid, s, -jnp.inf)
    m = jnp.maximum(state.m, jax.lax.stop_gradient(jnp.max(s, axis=-1)))
    base = jnp.where(jnp.isfinite(m), m, 0.0)  # a row that sees nothing yet: exp(-inf) = 0
    p = jnp.exp(s - base[..., None])
    shrink = jnp.exp(state.m - base)
    l = state.l * shrink + jnp.sum(p, axis=-1)  # noqa: E741
    kept = p if block.drop is None else p * block.drop
    pv = jnp.einsum("bgrqk,bkgd->bgrqd", kept, block.v, preferred_element_type=F32)
    return State(m, l, state.acc * shrink[..., None] + pv)


def finish(state: State) -> tuple[Any, Any]:
    """The output `(B, Tq, G, R, Dv)` (float32; 0 where a query saw no key) and the
    log-sum-exp per row `(B, G, R, Tq)` (`inf` there, so that its weights are 0)."""
    seen = state.l > 0
    l = jnp.where(seen, state.l, 1.0)  # noqa: E741
    out = jnp.where(seen[..., None], state.acc / l[..., None], 0.0)
    lse = jnp.where(seen, state.m + jnp.log(l), jnp.inf)
    return jnp.moveaxis(out, 3, 1), lse


def attend(block: Block, *, causal: bool, scale: float) -> Any:
    """Attention of every query of `block` on every key of it, `(B, Tq, G, R, Dv)`
    float32: one online-softmax step, differentiated by JAX."""
    b, tq, g, r, _ = block.q.shape
    state = start(b, g, r, tq, block.v.shape[-1])
    out, _ = finish(update(state, block, causal=causal, scale=scale))
    return out


class Grads(NamedTuple):
    dq: Any  # (B, Tq, G, R, Dk)
    dk: Any  # (B, Tk, G, Dk)
    dv: Any  # (B, Tk, G, Dv)


def grads(block: Block, dout: Any, lse: Any, delta: Any, *, causal: bool, scale: float) -> Grads:
    """The gradients of one block, float32, from the row statistics of the whole forward
    pass: `dout` `(B, G, R, Tq, Dv)` the output's cotangent, `lse` its log-sum-exp and
    `delta` `(B, G, R, Tq)` the row sums of `dout * out` (FlashAttention's backward)."""
    s = scores(block.q, block.k, scale)
    p = jnp.exp(s - lse[..., None])
    valid = block.valid(causal)
    if valid is not None:
        p = jnp.where(valid, p, 0.0)
    kept = p if block.drop is None else p * block.drop
    dv = jnp.einsum("bgrqk,bgrqd->bkgd", kept, dout, preferred_element_type=F32)
    dp = jnp.einsum("bgrqd,bkgd->bgrqk", dout, block.v, preferred_element_type=F32)
    if block.drop is not None:  # `delta` is still the row sum of `dout * out`
        dp = dp * block.drop
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bgrqk,bkgd->bqgrd", ds, block.k, preferred_element_type=F32)
    dk = jnp.einsum("bgrqk,bqgrd->bkgd", ds, block.q, preferred_element_type=F32)
    return Grads(dq, dk, dv)


class Draw(NamedTuple):
    """Where a device's dropout bits come from: the key, and the global indices of the
    device's first example and first query head (its examples and heads follow)."""

    key: Any
    example: Any
    head: Any


def dropout_factors(draw: Draw, p: float, shape: tuple[int, ...], *blocks: Any) -> Any:
    """Each attention weight's dropout factor, float32 of `shape` `(B, G, R, Tq, Tk)`: 0
    with probability `p`, else `1/(1-p)`. Each example and query head draws its own bits
    from the key folded with the indices `blocks` (the query and key blocks', or the
    device's), then the example's and the head's global index: the same bits whichever
    devices hold the examples and heads, and the same each time."""
    b, g, r, tq, tk = shape
    key = draw.key
    for index in blocks:
        key = jax.random.fold_in(key, index)

    def one(example: Any, head: Any) -> Any:
        mine = jax.random.fold_in(jax.random.fold_in(key, example), head)
        return jax.random.bernoulli(mine, 1.0 - p, (tq, tk))

    examples, heads = draw.example + jnp.arange(b), draw.head + jnp.arange(g * r)
    keep = jax.vmap(lambda e: jax.vmap(lambda h: one(e, h))(heads))(examples)
    keep = keep.reshape(b, g, r, tq, tk)
    return jnp.where(keep, 1.0 / (1.0 - p) if p < 1 else 0.0, 0.0).astype(F32)
