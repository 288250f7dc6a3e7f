"""`pipeline_value_and_grad`'s own argument checks (beyond those it shares with
`filter_pipeline`, in `_pipeline.checks`): `loss`, `on_tick`, `schedule`, a mesh with
devices, no traced leaves, `targets`, and a scalar loss."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from ... import _compat
from ..._tree import Flat, leaf_error, pathstr, shape_str
from ..checks import array_leaves


def check_mpmd(
    verb: str, loss: Any, schedule: Any, schedules: tuple[str, ...], mesh: Any, on_tick: Any
) -> None:
    """The MPMD pipeline's own arguments: `loss` (and `on_tick`) callable, a known
    `schedule`, and a mesh with devices (each stage's program runs on its own devices)."""
    if not callable(loss):
        raise TypeError(
            f"`{verb}` needs `loss` to be a callable `loss(y) -> scalar` (or `loss(y, t)` "
            f"with `targets`), but got {type(loss).__name__}."
        )
    if on_tick is not None and not callable(on_tick):
        raise TypeError(
            f"`{verb}(on_tick=...)` takes `None` or a callable `on_tick(held, held_bytes)`, "
            f"but got {type(on_tick).__name__}."
        )
    if schedule not in schedules:
        raise ValueError(
            f"`{verb}(schedule=...)` takes one of {', '.join(repr(s) for s in schedules)}, but "
            f"got {schedule!r}."
        )
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"`{verb}` runs each stage on its own devices, so it needs a `jax.sharding.Mesh` "
            f"with devices, but got a {type(mesh).__name__}. Pass `mesh=` a concrete mesh "
            "(`jax.make_mesh(...)`), or set one with `jax.set_mesh`."
        )


def check_concrete(verb: str, **trees: Any) -> None:
    """No traced leaves: each stage is its own program, run from Python, outside `jit`."""
    rows = []
    for name, tree in trees.items():
        flat = Flat(tree)
        rows += [
            (pathstr(flat.paths[i], name), type(flat.leaves[i]).__name__)
            for i in flat.array_indices
            if _compat.is_tracer(flat.leaves[i])
        ]
    if rows:
        raise ValueError(
            leaf_error(
                f"`{verb}` runs each stage as its own compiled program and moves data between "
                "them from Python, so it cannot run inside `jit`, `grad` or `vmap`; got "
                "these traced leaves:",
                rows,
                "Call it outside any transformation: it returns the value and the gradients "
                "itself (apply the optimiser to them in a `jit` of its own).",
            )
        )


def check_targets(verb: str, targets: Any, batch: int) -> None:
    """`targets` (if given): arrays with the batch of `x` as their leading dim."""
    if targets is None:
        return
    flat = array_leaves(
        verb,
        "targets",
        targets,
        "cut into microbatches as `x` is",
        "Pass arrays, or `targets=None` and a `loss(y)` that needs none (other values can "
        "reach `loss` by closure).",
    )
    arrays = set(flat.array_indices)
    rows = [
        (pathstr(flat.paths[i]), f"shape {shape_str(flat.leaves[i].shape)}")
        for i in sorted(arrays)
        if not flat.leaves[i].ndim or flat.leaves[i].shape[0] != batch
    ]
    if rows:
        raise ValueError(
            leaf_error(
                f"`{verb}` needs the leaves of `targets` to have the batch of `x` ({batch}) as "
                "their leading dim; these do not:",
                rows,
                "Pass one target row per row of `x`.",
            )
        )


def check_scalar_loss(verb: str, loss: Any, x: Any, targets: Any, microbatches: int) -> None:
    """`loss` returns a scalar on a microbatch of the output (shaped as `x`'s) and targets."""

    def cut(a: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((a.shape[0] // microbatches, *a.shape[1:]), a.dtype)

    given = (x,) if targets is None else (x, targets)
    out = jax.eval_shape(loss, *jax.tree.map(cut, given))
    if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == ()):
        got = jax.tree.map(lambda a: tuple(a.shape), out)
        raise ValueError(
            f"`{verb}` needs `loss` to return a scalar (shape `()`) for a microbatch, but it "
            f"returned shape {got}. Reduce it inside `loss` (e.g. `jnp.mean(...)` over the "
            "microbatch's rows): the value is the mean of `loss` over the microbatches."
        )
