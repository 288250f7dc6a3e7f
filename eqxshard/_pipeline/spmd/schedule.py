"""The per-device program of `filter_pipeline`: each stage runs its own layers on one
microbatch per tick and passes the result to the next stage by a collective permute.

Runs inside `shard_map` over the stage axis (`S` stages). Each stage holds `R` chunks of
`L` layers (`R` = `repeats`), stage-major (`stage_major`): chunk `c` of the layer stack
(layers `c*L .. c*L+L-1`) runs on stage `c % S`, as its local chunk `c // S`. For `R = 1`
this is the GPipe schedule, for `R > 1` the circular one: the same loop.

The loop runs `M*R + S - 1` ticks (`M` microbatches). At tick `t` stage `s` works on item
`k = t - s` (microbatch `k % M`, pass `k // M`, its local chunk; idle when `k` is outside
`0 .. M*R-1`: the bubble, `bubble.bubble_fraction`). Stage 0 takes microbatch `m` from the
input on the first pass and from what the last stage sent back (kept in a buffer of `M`
microbatches) on later ones, so circular needs `M >= S`. The last stage's results on the
last pass are the output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ... import _compat


def run_stages(
    step: Callable[[Any, Any], Any],
    local: Any,
    xs: Any,
    *,
    axis: str,
    stages: int,
    microbatches: int,
    repeats: int,
) -> Any:
    """The loop on one stage. `step(weights_of_one_layer, h) -> h`; `local`: this stage's
    layers, stage-major (`R*L` leading); `xs`: the input cut into microbatches (`M`
    leading). Returns the output's microbatches, the same on every stage."""
    S, M, R = stages, microbatches, repeats
    s = jax.lax.axis_index(axis)
    local = jax.tree.map(lambda a: a.reshape(R, a.shape[0] // R, *a.shape[1:]), local)
    ring = [(i, (i + 1) % S) for i in range(S)]

    def pick(cond: Any, a: Any, b: Any) -> Any:
        return jax.tree.map(lambda u, v: jnp.where(cond, u, v), a, b)

    def get(tree: Any, i: Any) -> Any:
        return jax.tree.map(lambda a: a[i], tree)

    def put(tree: Any, i: Any, value: Any, cond: Any) -> Any:
        return jax.tree.map(lambda a, v: a.at[i].set(jnp.where(cond, v, a[i])), tree, value)

    def chunk(r: Any, h: Any) -> Any:
        # GPipe's one chunk is a constant of the loop, which the backward pass keeps once;
        # a chunk picked by the tick is kept for the backward pass at every tick.
        weights = get(local, r if R > 1 else 0)
        return jax.lax.scan(lambda h, w: (step(w, h), None), h, weights)[0]

    def item(k: Any) -> tuple[Any, Any, Any]:
        """Work item `k`: whether it exists, its pass and its microbatch."""
        kc = jnp.clip(k, 0, M * R - 1)
        return (k >= 0) & (k < M * R), kc // M, kc % M

    def tick(state: tuple[Any, Any, Any], t: Any) -> tuple[tuple[Any, Any, Any], None]:
        carry, back, outs = state
        valid, r, m = item(t - s)
        first = pick(r == 0, get(xs, m), get(back, m))
        h = chunk(r, pick(s == 0, first, carry))
        outs = put(outs, m, h, valid & (s == S - 1) & (r == R - 1))
        sent = jax.tree.map(lambda a: jax.lax.ppermute(a, axis, ring), h)
        # Stage 0 keeps what the last stage sent it for that microbatch's next pass.
        valid, r, m = item(t - (S - 1))
        back = put(back, m, sent, (s == 0) & valid & (r < R - 1))
        return (sent, back, outs), None

    vary = lambda tree: jax.tree.map(lambda a: _compat.to_varying(a, axis), tree)
    zeros = jax.tree.map(jnp.zeros_like, xs)
    init = (vary(get(zeros, 0)), vary(zeros), vary(zeros))
    (_, _, outs), _ = jax.lax.scan(tick, init, jnp.arange(M * R + S - 1))
    # Only the last stage holds the output: the sum over stages gives it to every stage.
    # One `psum` per leaf, not one of them all: jax 0.7's transpose of a `psum` asserts
    # that all its operands are differentiated, and a leaf that does not depend on what
    # is differentiated (a key passed alongside `h`, a part of `h` the layers keep) is not.
    last = jax.tree.map(lambda a: jnp.where(s == S - 1, a, jnp.zeros_like(a)), outs)
    return jax.tree.map(lambda a: jax.lax.psum(a, axis), last)
