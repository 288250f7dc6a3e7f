"""The MPMD pipeline's driver: each stage's programs (`programs`) run on its own sub-mesh
(`submeshes`) from Python, tick by tick in the order `ticks` gives, with activations and
cotangents moved between sub-meshes by `filter_put`.

The driver holds a microbatch's residuals from its forward to its backward and no longer:
that is what the order bounds (1F1B: at most `S` microbatches' per stage; GPipe: all `M`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..._placement.put import filter_put
from . import submeshes
from .programs import backward, forward, forward_last
from .ticks import ticks


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
                        forward_last,
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
                    out, kept, how = _on(meshes[s], forward, layer, static, policy, pieces[s], h)
                    inbox[("F", s + 1, m)] = submeshes.move(out, meshes[s + 1])
                held[s][m] = (kept, how)
            else:
                kept, how = held[s].pop(m)
                cotangent = None if s == S - 1 else inbox.pop(("B", s, m))
                totals[s], grad_h = _on(
                    meshes[s], backward, kept, how, pieces[s], cotangent, totals[s]
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
