"""Meshes, axis types and specs as every supported JAX spells them."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec


def _concrete_mesh() -> Mesh | None:
    get_mesh = getattr(jax.sharding, "get_mesh", None)  # public from jax 0.8
    try:
        if get_mesh is not None:
            mesh = get_mesh()
        else:
            from jax._src import mesh as mesh_lib

            mesh = mesh_lib.get_concrete_mesh()
    except Exception:  # inside jit, `get_mesh` raises: only the abstract mesh is known
        return None
    if mesh is None or mesh.empty:
        return None
    return mesh


def _legacy_mesh() -> Mesh | None:
    """The mesh of the deprecated `with mesh:` context manager, if one is active."""
    from jax._src import mesh as mesh_lib

    mesh = mesh_lib.thread_resources.env.physical_mesh
    return None if mesh.empty else mesh


def ambient_mesh() -> Mesh | AbstractMesh | None:
    """The mesh set by `jax.set_mesh` (or the legacy `with mesh:`), or `None`.

    Outside `jit` this is the concrete `Mesh`; inside `jit` JAX only exposes the
    `AbstractMesh` (axis names, sizes and types, but no devices).
    """
    concrete = _concrete_mesh()
    if concrete is not None:
        return concrete
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty:
        return abstract
    return _legacy_mesh()


def context_abstract_mesh() -> AbstractMesh | None:
    """The abstract mesh currently in context, or `None`."""
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract.empty else abstract


def nested_mesh(mesh: Mesh | AbstractMesh) -> Mesh | AbstractMesh:
    """The mesh a `jax.shard_map` over `mesh` takes where it is called: inside an outer
    `shard_map` over a mesh of the same axes (some of them then Manual), the abstract mesh
    JAX has in context (JAX refuses the concrete mesh there); `mesh` itself elsewhere."""
    context = context_abstract_mesh()
    if (
        context is not None
        and AxisType.Manual in tuple(context.axis_types)
        and dict(context.shape) == dict(mesh.shape)
    ):
        return context
    return mesh


def manual_axes_here() -> frozenset[str]:
    """The mesh axes an enclosing `shard_map` has made Manual where this is called (none
    outside one)."""
    context = context_abstract_mesh()
    if context is None:
        return frozenset()
    return frozenset(n for n, t in axis_type_map(context).items() if t == AxisType.Manual)


def tracing_on(mesh: Mesh | AbstractMesh | None) -> Any:
    """A context in which a function traced for `mesh` finds it: `mesh`'s abstract mesh
    where it has Explicit axes and no mesh is set (jax >= 0.11 looks an Explicit axis up
    there, and an op such as an `Embedding`'s lookup otherwise fails with "Resource axis
    ... is not found in mesh: ()"); a context that does nothing otherwise."""
    if (
        mesh is None
        or AxisType.Explicit not in tuple(mesh.axis_types)
        or not jax.sharding.get_abstract_mesh().empty
    ):
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(abstract_mesh_of(mesh))


def abstract_mesh_of(mesh: Mesh | AbstractMesh) -> AbstractMesh:
    return mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh


def axis_type_map(mesh: Mesh | AbstractMesh) -> dict[str, AxisType]:
    """Each mesh axis name and its `AxisType` (`Auto`, `Explicit` or `Manual`)."""
    return dict(zip(mesh.axis_names, mesh.axis_types, strict=True))


def mesh_platform(mesh: Mesh | AbstractMesh) -> str | None:
    """The platform (`"cpu"`, `"gpu"`, ...) of a mesh, or `None` where JAX does not say."""
    if isinstance(mesh, Mesh):
        return mesh.devices.flat[0].platform if mesh.devices.size else None
    device = getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None)  # jax >= 0.8; older ones do not say
    return platform if isinstance(platform, str) else None


def abstract_mesh(
    axis_sizes: tuple[int, ...],
    axis_names: tuple[str, ...],
    axis_types: tuple[AxisType, ...] | None = None,
) -> AbstractMesh:
    """`AbstractMesh(axis_sizes, axis_names, axis_types)`: a mesh of any size, no devices.

    The constructor takes the same arguments from jax 0.7.2 to 0.12, but its default axis
    types changed: `Auto` up to jax 0.10, `Explicit` from 0.11 (measured on 0.12). `None`
    here means `Auto` on every version.
    """
    if axis_types is None:
        axis_types = (AxisType.Auto,) * len(axis_names)
    return AbstractMesh(tuple(axis_sizes), tuple(axis_names), axis_types)


def spec_entries(spec: PartitionSpec) -> tuple[Any, ...]:
    """The per-dim entries of `spec`, without its `unreduced`/`reduced` sets.

    JAX refuses to iterate a `PartitionSpec` that has non-empty `unreduced`/`reduced`
    sets (jax >= 0.8) and offers `spec.partitions` instead; older releases have neither.
    """
    partitions = getattr(spec, "partitions", None)
    return tuple(spec) if partitions is None else tuple(partitions)


def spec_str(spec: Any) -> str:
    """`spec` as `P('data', None)`, the same on every jax version (jax 0.7 prints
    `PartitionSpec(...)`), with its `unreduced`/`reduced` sets where it has them."""
    if not isinstance(spec, PartitionSpec):
        return repr(spec)
    text = repr(spec_entries(spec))[1:-1]
    for name in ("unreduced", "reduced"):
        axes = getattr(spec, name, None)
        if axes:
            text += f", {name}={set(axes)!r}"
    return f"P({text})"


def spec_reductions(spec: PartitionSpec) -> frozenset[str]:
    """The mesh axes in `spec`'s `unreduced` and `reduced` sets (empty where JAX has none)."""
    unreduced = getattr(spec, "unreduced", None) or frozenset()
    reduced = getattr(spec, "reduced", None) or frozenset()
    return frozenset(unreduced) | frozenset(reduced)


def vmapped_mesh_axes() -> frozenset[str]:
    """The Explicit mesh axes an enclosing `vmap` has taken for its batch dim.

    `jax.shard_map` leaves them out of its default `axis_names` and refuses them in
    `axis_names` (jax >= 0.8); older releases do not record them.
    """
    from jax._src import core

    env = core.get_axis_env()
    return frozenset(getattr(env, "explicit_mesh_axis_names", ()) or ())


def is_sharding_type_error(e: BaseException) -> bool:
    """Whether `e` is JAX's `ShardingTypeError` (an op whose output layout JAX cannot
    infer on Explicit mesh axes). The class is private (`jax._src.core`) and not in every
    release's public API, so it is matched by name over the exception's classes."""
    return any(c.__name__ == "ShardingTypeError" for c in type(e).__mro__)
