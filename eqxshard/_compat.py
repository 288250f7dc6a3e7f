"""The only module that touches private or version-specific JAX API.

Everything here is small on purpose: when JAX moves an API, this is the one file to fix.
Supported: jax 0.7.2 (the lowest, tested in CI) to the newest release.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding

Tracer = jax.core.Tracer  # pyright: ignore[reportAttributeAccessIssue]


def is_tracer(x: Any) -> bool:
    """Whether `x` is being traced (by `jit`, `vmap`, `grad`, `eval_shape`, ...).

    Decided per leaf, never by a global probe: a probe such as
    `isinstance(jnp.zeros(()), Tracer)` is wrong under `vmap`/`grad` without `jit`.
    """
    return isinstance(x, Tracer)


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


def abstract_mesh_of(mesh: Mesh | AbstractMesh) -> AbstractMesh:
    return mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh


def axis_type_map(mesh: Mesh | AbstractMesh) -> dict[str, AxisType]:
    """Each mesh axis name and its `AxisType` (`Auto`, `Explicit` or `Manual`)."""
    return dict(zip(mesh.axis_names, mesh.axis_types, strict=True))


def traced_sharding(x: Any) -> jax.sharding.NamedSharding | None:
    """The sharding JAX attaches to a tracer's abstract value, if it has one."""
    aval = getattr(x, "aval", None)
    sharding = getattr(aval, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    return None


def mesh_platform(mesh: Mesh | AbstractMesh) -> str | None:
    """The platform (`"cpu"`, `"gpu"`, ...) of a mesh, or `None` where JAX does not say."""
    if isinstance(mesh, Mesh):
        return mesh.devices.flat[0].platform if mesh.devices.size else None
    device = getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None)  # jax >= 0.8; older ones do not say
    return platform if isinstance(platform, str) else None


_JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:2])


def reshard_explicit(x: Any, sharding: NamedSharding) -> Any:
    """Reshards a traced leaf over Explicit mesh axes.

    jax >= 0.8: `device_put` with a `NamedSharding` does it inside `jit`, with or without
    the mesh in context (`reshard` needs the mesh in context for inputs not yet on it).
    jax 0.7: `device_put` inside `jit` is an identity there, so `reshard` is used; for an
    input not yet on the mesh JAX then asks for `jax.set_mesh(mesh)` around the call.
    """
    if _JAX_VERSION >= (0, 8):
        return jax.device_put(x, sharding)
    return jax.sharding.reshard(x, sharding)


def memory_space(memory_kind: str) -> Any:
    """The `jax.memory.Space` that `device_put` takes inside `jit` for a memory kind."""
    if memory_kind == "device":
        return jax.memory.Space.Device
    if memory_kind in ("pinned_host", "unpinned_host"):
        return jax.memory.Space.Host
    raise ValueError(f"unknown memory kind {memory_kind!r}")


def is_prng_key(x: Any) -> bool:
    """Whether `x` is a typed PRNG key array (`jax.random.key`), which NumPy cannot hold."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def process_allgather(tree: Any, *, tiled: bool) -> Any:
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=tiled)


def allgather_host(values: np.ndarray) -> np.ndarray:
    """Gathers a small host array from every process: shape `(process_count, *values.shape)`."""
    if jax.process_count() == 1:
        return values[None]
    return np.asarray(process_allgather(values, tiled=False))
