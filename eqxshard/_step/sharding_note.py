"""A note on JAX's `ShardingTypeError` raised while `filter_jit` traces the user's function
on a mesh with Explicit axes: what it means for an Equinox model and what to change."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding

from .. import _compat


def _explicit_axes(config: Any, args: tuple, kwargs: dict) -> list[str]:
    """The Explicit axes of the meshes this call runs on: `filter_jit`'s `mesh`, the one
    set by `jax.set_mesh`, and those its array arguments are laid out over."""
    meshes = [getattr(config, "mesh", None), _compat.ambient_mesh()]
    for x in jax.tree_util.tree_leaves((args, kwargs)):
        sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
        if isinstance(sharding, NamedSharding):
            meshes.append(sharding.mesh)
    axes: list[str] = []
    for mesh in meshes:
        if mesh is None or not hasattr(mesh, "axis_names"):
            continue
        for name, kind in _compat.axis_type_map(mesh).items():
            if kind == AxisType.Explicit and name not in axes:
                axes.append(name)
    return axes


def note(axes: list[str]) -> str:
    return (
        f"eqxshard: this step runs on a mesh with Explicit axes ({', '.join(map(repr, axes))}). "
        "On Explicit axes JAX must know the layout of every op's output, and it cannot infer "
        "this op's (in Equinox models, e.g. an `eqx.nn.Embedding` lookup of a row-split batch, "
        "or a convolution with split weights). Most Equinox models are written for Auto axes: "
        "build the mesh with them, `jax.make_mesh(shape, names, "
        "axis_types=(jax.sharding.AxisType.Auto,) * len(shape))`, or give this op its output "
        "layout with `out_sharding=`, as the message above says."
    )


@contextlib.contextmanager
def explained(config: Any, args: tuple, kwargs: dict) -> Iterator[None]:
    """Adds `note` to a `ShardingTypeError` raised inside, when the call's meshes have
    Explicit axes; the error, its message and its traceback are otherwise unchanged."""
    try:
        yield
    except Exception as e:
        if _compat.is_sharding_type_error(e):
            axes = _explicit_axes(config, args, kwargs)
            if axes and not any("eqxshard: this step" in n for n in getattr(e, "__notes__", ())):
                e.add_note(note(axes))
        raise
