"""The MPMD pipeline's driver: each stage its own compiled programs on its own sub-mesh,
run in the order `ticks` gives, with activations and cotangents moved between sub-meshes
by `filter_put`.

Per stage there are two programs, each compiled once per stage and cached across calls
(`eqx.filter_jit`, keyed by `layer`, `loss`, the stack's non-array part and the remat
policy, as `eqx.filter_jit` users expect): the forward of a microbatch, `jax.vjp` of the
stage's layers (the last stage's with the loss), which returns the output and the
residuals the backward needs, and the backward, which takes them (plus the stage's
weights, which the residuals would otherwise copy once per microbatch), the cotangent of
the output and the stage's running weight gradient. The driver holds a microbatch's
residuals from its forward to its backward and no longer: that is what the schedule's
order bounds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._placement.put import filter_put
from . import submeshes
from .remat import with_remat
from .ticks import ticks


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
def _forward(layer, static, policy, weights, h):
    out, pullback = jax.vjp(_stage_fn(layer, static, policy), weights, h)
    return _residuals(out, pullback, weights)


@eqx.filter_jit
def _forward_last(layer, static, policy, loss, scale, weights, h, target):
    run = _stage_fn(layer, static, policy)
    value = lambda w, h: loss(run(w, h), *target) * scale  # noqa: E731
    out, pullback = jax.vjp(value, weights, h)
    return _residuals(out, pullback, weights)


@eqx.filter_jit
def _backward(kept, how, weights, cotangent, total):
    if cotangent is None:  # the last stage: the output is its loss
        cotangent = jnp.ones((), how[2])
    grad_w, grad_h = _pullback(kept, how, weights)(cotangent)
    return jax.tree.map(jnp.add, total, grad_w), grad_h


@eqx.filter_jit
def _cut(xs, microbatches):
    """Microbatch `m` is rows `m, m+M, ...` (as `filter_pipeline` cuts)."""
    size = jax.tree.leaves(xs)[0].shape[0] // microbatches
    split = lambda a: a.reshape(size, microbatches, *a.shape[1:])  # noqa: E731
    stacked = jax.tree.map(split, xs)
    return [jax.tree.map(lambda a, m=m: a[:, m], stacked) for m in range(microbatches)]


@eqx.filter_jit
def _join(parts):
    glue = lambda *a: jnp.stack(a, 1).reshape(-1, *a[0].shape[1:])  # noqa: E731
    return jax.tree.map(glue, *parts)


@eqx.filter_jit
def _total(values):
    return sum(values[1:], values[0])


def _on(mesh: Mesh, program: Callable[..., Any], *args: Any) -> Any:
    """`program(*args)` with `mesh` (a stage's) as the mesh in context, whatever mesh the
    caller set with `jax.set_mesh`: `jit` refuses inputs on devices outside the context
    mesh, and Explicit axes are looked up there."""
    with jax.set_mesh(mesh):
        return program(*args)


def _zeros(piece: Any) -> Any:
    host = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), piece)
    return filter_put(host, jax.tree.map(lambda a: a.sharding, piece))


def _batch_on(tree: Any, mesh: Mesh, batch_axes: tuple[str, ...]) -> Any:
    return filter_put(tree, NamedSharding(mesh, PartitionSpec(batch_axes or None)))


def _bytes_per_device(arrays: list[Any]) -> int:
    per: dict[Any, int] = {}
    for a in arrays:
        for sh in a.addressable_shards:
            per[sh.device] = per.get(sh.device, 0) + sh.data.nbytes
    return max(per.values(), default=0)


def run_mpmd(
    layer: Callable[[Any, Any], Any],
    weights: Any,
    static: Any,
    x: Any,
    loss: Callable[..., Any],
    targets: Any,
    *,
    mesh: Mesh,
    axis: str,
    microbatches: int,
    batch_axes: tuple[str, ...],
    policy: str,
    schedule: str,
    on_tick: Callable[[list[int], list[int]], object] | None = None,
) -> tuple[Any, Any, Any]:
    """The step on checked arguments: `(value, grad of weights, grad of x)`. `on_tick`, if
    given, is called after each tick with the microbatches' residuals each stage holds and
    their bytes on the stage's fullest device."""
    meshes = submeshes.stage_meshes(mesh, axis)
    S, M = len(meshes), microbatches
    laid, pieces = submeshes.split(weights, mesh, axis, meshes)
    xs = _on(meshes[0], _cut, _batch_on(x, meshes[0], batch_axes), M)
    has_targets, ts = targets is not None, []
    if has_targets:
        ts = _on(meshes[-1], _cut, _batch_on(targets, meshes[-1], batch_axes), M)
    totals = [_zeros(p) for p in pieces]
    held: list[dict[int, Any]] = [{} for _ in range(S)]
    inbox: dict[tuple[str, int, int], Any] = {}
    values, grad_x = [], [None] * M
    scale = 1.0 / M
    for tick in ticks(schedule, S, M):
        for s, kind, m in tick:
            if kind == "F":
                h = xs[m] if s == 0 else inbox.pop(("F", s, m))
                if s == S - 1:
                    target = (ts[m],) if has_targets else ()
                    out, kept, how = _on(
                        meshes[s],
                        _forward_last,
                        layer,
                        static,
                        policy,
                        loss,
                        scale,
                        pieces[s],
                        h,
                        target,
                    )
                    values.append(out)
                else:
                    out, kept, how = _on(meshes[s], _forward, layer, static, policy, pieces[s], h)
                    inbox[("F", s + 1, m)] = submeshes.move(out, meshes[s + 1])
                held[s][m] = (kept, how)
            else:
                kept, how = held[s].pop(m)
                cotangent = None if s == S - 1 else inbox.pop(("B", s, m))
                totals[s], grad_h = _on(
                    meshes[s], _backward, kept, how, pieces[s], cotangent, totals[s]
                )
                if s > 0:
                    inbox[("B", s - 1, m)] = submeshes.move(grad_h, meshes[s - 1])
                else:
                    grad_x[m] = grad_h
        if on_tick is not None:
            kept_arrays = [[a for kept, _ in h.values() for a in kept] for h in held]
            on_tick([len(h) for h in held], [_bytes_per_device(k) for k in kept_arrays])
    value = _on(meshes[-1], _total, values)
    grad_w = submeshes.join(totals, pieces, laid)
    return value, grad_w, _on(meshes[0], _join, grad_x)
