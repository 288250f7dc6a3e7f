"""Each stage's two compiled programs in the MPMD pipeline: the forward of a microbatch and
its backward.

The forward is `jax.vjp` of the stage's layers (the last stage's with the loss): it returns
the output and the residuals the backward needs, less the stage's weights, which the
backward is given again (kept among the residuals, they would be held once per
microbatch). The backward takes the residuals, the weights, the cotangent of the output and
the stage's running weight gradient. Each is an `eqx.filter_jit`, so it compiles once per
stage (its sub-mesh, its piece of the stack) and is cached across calls, keyed by `layer`,
`loss`, the stack's non-array part and the remat policy, as `eqx.filter_jit` users expect.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ..remat import with_remat


def _stage_fn(layer: Callable[[Any, Any], Any], static: Any, policy: str) -> Callable:
    step = with_remat(lambda w, h: layer(eqx.combine(w, static), h), policy)
    return lambda w, h: jax.lax.scan(lambda h, p: (step(p, h), None), h, w)[0]


def _residuals(out: Any, pullback: Any, weights: Any) -> tuple[Any, Any, Any]:
    """The pullback's arrays without the stage's weights (the backward gets them again),
    and what puts them back: its tree and where each weight leaf was."""
    leaves, tree = jax.tree.flatten(pullback)
    given = jax.tree.leaves(weights)
    where = tuple(next((j for j, w in enumerate(given) if w is a), -1) for a in leaves)
    kept = [a for a, j in zip(leaves, where, strict=True) if j < 0]
    return out, kept, (tree, where, jnp.result_type(*jax.tree.leaves(out)))


def _pullback(kept: list[Any], how: tuple[Any, tuple[int, ...], Any], weights: Any) -> Any:
    tree, where, _ = how
    given, rest = jax.tree.leaves(weights), iter(kept)
    return jax.tree.unflatten(tree, [given[j] if j >= 0 else next(rest) for j in where])


@eqx.filter_jit
def forward(layer, static, policy, weights, h):
    """A stage's layers on microbatch `h`: `(output, residuals, how to rebuild the
    pullback)`."""
    out, pullback = jax.vjp(_stage_fn(layer, static, policy), weights, h)
    return _residuals(out, pullback, weights)


@eqx.filter_jit
def forward_last(layer, static, policy, loss, scale, weights, h, target):
    """The last stage's `forward`, its output the microbatch's loss times `scale`."""
    run = _stage_fn(layer, static, policy)
    value = lambda w, h: loss(run(w, h), *target) * scale  # noqa: E731
    out, pullback = jax.vjp(value, weights, h)
    return _residuals(out, pullback, weights)


@eqx.filter_jit
def backward(kept, how, weights, cotangent, total):
    """A stage's backward of one microbatch: `(total + its weight gradient, the gradient of
    its input)`; `cotangent=None` on the last stage, whose output is the loss."""
    if cotangent is None:
        cotangent = jnp.ones((), how[2])
    grad_w, grad_h = _pullback(kept, how, weights)(cotangent)
    return jax.tree.map(jnp.add, total, grad_w), grad_h
