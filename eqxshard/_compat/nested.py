"""`jax.shard_map` nested in an outer `shard_map` (a pipeline's stage), with a backward
pass that lowers.

Differentiating a `shard_map` nested in another fails on jax 0.7.2, 0.10.2 and 0.12
(measured; the forward pass works): JAX hands the inner map's residuals (what its forward
pass keeps for its backward pass) on with specs that name the outer map's Manual axes
too, e.g. `P(('stage', 'context'))`. Shardy refuses them ("'sdy.manual_computation' op
operand ... operates on axis "stage" which is already bound by a parent
sdy.manual_computation op", or "... manual axis "context" after free axis "stage""); jax
0.7.2 refuses them while tracing ("Tuple subset of `PartitionSpec` cannot contain
`Manual` mixed with `Auto` or `Explicit`"). Two passes make such residuals: the
linearisation of the map itself, and a partial evaluation of the differentiated program
that splits the map's input-free work (an `iota`, zeros) from the rest (`lax.scan` does
one to hoist loop-invariant work out of its body: a pipeline's loop over ticks).

Nested, the map here keeps none: its backward pass is a second `shard_map` over the same
axes that runs the function again and applies its `jax.vjp` (what `jax.checkpoint`
would recompute), and the forward map runs under `jax.checkpoint` keeping nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from .meshes import manual_axes_here


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _spec_leaves(specs: Any, tree: Any) -> list[PartitionSpec]:
    """One spec per array leaf of `tree`, `specs` a prefix of it (as `jax.shard_map` takes)."""
    spread = lambda spec, x: jax.tree.map(lambda _: spec, x)
    per_leaf = jax.tree.map(spread, specs, tree, is_leaf=_is_spec)
    return jax.tree.leaves(per_leaf, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _differentiable(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)  # not integers, booleans, keys, float0


def nested_shard_map(
    f: Callable[..., Any],
    *,
    mesh: Mesh | AbstractMesh,
    in_specs: tuple[Any, ...],
    out_specs: Any,
    axis_names: frozenset[str],
    check_vma: bool = True,
) -> Callable[..., Any]:
    """`jax.shard_map(f, ...)` with these arguments; inside an outer `shard_map` (some mesh
    axes Manual where it is called), one whose backward pass recomputes `f` (see the
    module's docstring). `in_specs` is a tuple, one entry per positional argument (`None`
    for an argument that is `None`). Only inexact (float) leaves are differentiated; the
    others (integers, booleans, keys) get no cotangent."""

    def mapped(g: Callable[..., Any], ins: Any, outs: Any) -> Callable[..., Any]:
        return jax.shard_map(
            g, mesh=mesh, in_specs=ins, out_specs=outs, axis_names=axis_names, check_vma=check_vma
        )

    if not manual_axes_here():
        return mapped(f, in_specs, out_specs)

    # Under `jax.checkpoint` keeping nothing, partial evaluation keeps no residual inside
    # the map either (it recomputes what it would have kept); `forward` calls `run`, so
    # that a partial evaluation of the differentiated program meets the same wrapping.
    policy = jax.checkpoint_policies.nothing_saveable

    @jax.custom_vjp
    def run(*args: Any) -> Any:
        return jax.checkpoint(mapped(f, in_specs, out_specs), policy=policy)(*args)

    def forward(*args: Any) -> tuple[Any, tuple[Any, ...]]:
        return run(*args), args

    def backward(args: tuple[Any, ...], ct: Any) -> tuple[Any, ...]:
        leaves, treedef = jax.tree.flatten(args)
        specs = _spec_leaves(in_specs, args)
        wrt = [i for i, x in enumerate(leaves) if _differentiable(x)]
        out_leaves = jax.tree.leaves(ct)
        out_spec_leaves = _spec_leaves(out_specs, ct)
        took = [i for i, c in enumerate(out_leaves) if _differentiable(c)]

        def per_device(*local: Any) -> list[Any]:
            given, cts = list(local[: len(leaves)]), local[len(leaves) :]

            def differentiated(*xs: Any) -> list[Any]:
                now = list(given)
                for i, x in zip(wrt, xs, strict=True):
                    now[i] = x
                out = jax.tree.leaves(f(*jax.tree.unflatten(treedef, now)))
                return [out[i] for i in took]

            _, vjp = jax.vjp(differentiated, *(given[i] for i in wrt))
            return list(vjp(list(cts)))

        grads = mapped(
            per_device,
            (*specs, *(out_spec_leaves[i] for i in took)),
            [specs[i] for i in wrt],
        )(*leaves, *(out_leaves[i] for i in took))
        full: list[Any] = [None] * len(leaves)
        for i, g in zip(wrt, grads, strict=True):
            full[i] = g
        return tuple(jax.tree.unflatten(treedef, full))

    run.defvjp(forward, backward)
    return run
