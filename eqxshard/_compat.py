"""The only module that touches private or version-specific JAX API.

Everything here is small on purpose: when JAX moves an API, this is the one file to fix.
Supported: jax 0.7.2 (the lowest, tested in CI) to the newest release.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

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

    `jax.sharding.reshard` is the one with the right `vmap` rule (the spec applies to each
    example, not to the batch dim) and transpose; `device_put` with a sharding has neither
    (on jax >= 0.8 it puts the spec on the batch dim under `vmap` and fails under `grad`
    on mixed meshes). `reshard` needs the input on the mesh, or the mesh in context: an
    input not yet on it is first put on it replicated (`device_put` to `P()`, which is
    right under `vmap` too), so no `jax.set_mesh` is needed.
    """
    target = abstract_mesh_of(sharding.mesh)
    traced = traced_sharding(x)
    on_mesh = traced is not None and abstract_mesh_of(traced.mesh) == target
    if not on_mesh and context_abstract_mesh() != target:
        x = jax.device_put(x, NamedSharding(sharding.mesh, PartitionSpec()))
    return jax.sharding.reshard(x, sharding)


def memory_kinds_in_jit() -> bool:
    """Whether `device_put` to a memory kind is honoured inside `jit` on this JAX and backend.

    Measured on CPU: jax 0.7.2 silently keeps the array in device memory on Auto meshes and
    fails in XLA ("Side-effect ops cannot be replicated") on Explicit ones; jax 0.10.2
    works. Other backends have supported memory kinds inside `jit` for longer.
    """
    return _JAX_VERSION >= (0, 8) or jax.default_backend() != "cpu"


# The memory kinds `memory_space` can express inside `jit`.
TRACED_MEMORY_KINDS = ("device", "pinned_host", "unpinned_host")


def memory_space(memory_kind: str) -> Any:
    """The `jax.memory.Space` that `device_put` takes inside `jit` for a memory kind."""
    if memory_kind == "device":
        return jax.memory.Space.Device
    if memory_kind in ("pinned_host", "unpinned_host"):
        return jax.memory.Space.Host
    raise ValueError(f"unknown memory kind {memory_kind!r}")


def traced_memory_space(x: Any) -> Any:
    """The `jax.memory.Space` a tracer's abstract value is in, or `None` where JAX does not say."""
    return getattr(getattr(x, "aval", None), "memory_space", None)


def is_prng_key(x: Any) -> bool:
    """Whether `x` is a typed PRNG key array (`jax.random.key`), which NumPy cannot hold."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def is_jax_dtype(dtype: Any) -> bool:
    """Whether JAX has arrays of `dtype`: booleans, numbers (bfloat16, float8 and int4
    included) and extended dtypes such as PRNG keys; not strings, bytes, objects,
    datetimes, timedeltas or records, which NumPy arrays can hold."""
    if jnp.issubdtype(dtype, jax.dtypes.extended):
        return True
    if np.dtype(dtype).kind in "USOMm":  # timedelta64 counts as a NumPy integer
        return False
    return bool(jnp.issubdtype(dtype, np.bool_) or jnp.issubdtype(dtype, np.number))


def tracing() -> bool:
    """Whether a transformation (`jit`, `vmap`, `grad`, ...) is tracing right now.

    Only for what cannot happen while tracing at all, such as a cross-process collective
    on host data (`process_allgather` refuses to run inside `jit`); placement itself is
    decided per leaf (`is_tracer`).
    """
    from jax._src import core

    return not core.trace_state_clean()


def process_allgather(tree: Any, *, tiled: bool) -> Any:
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=tiled)


def global_shape(mesh: Mesh, spec: Any, local_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The global shape that each process's local part of `local_shape` makes on `mesh`.

    What `jax.make_array_from_process_local_data` infers. Where JAX cannot say (an
    invalid spec, or a non-uniform layout), the local size is kept: the spec checks
    or JAX then report the problem.
    """
    from jax._src import sharding_impls

    try:
        inferred = sharding_impls.local_to_global_shape(NamedSharding(mesh, spec), local_shape)
    except Exception:
        return tuple(local_shape)
    return tuple(int(g) if g is not None else d for g, d in zip(inferred, local_shape, strict=True))


def shard_map_specs_from_trace(
    f: Any,
    *,
    mesh: Any,
    in_specs: tuple[PartitionSpec, ...],
    axis_names: frozenset[str],
    check_vma: bool,
) -> Any:
    """`jax.shard_map` for a function that picks its own `out_specs` while it is traced.

    `f(*args)` returns `(out_specs, outs)`, two lists of the same length: the output
    structure (and so the flat `out_specs`) is only known once `f` has run. JAX itself
    matches `out_specs` against the output only after tracing `f` (measured on jax 0.7.2
    and 0.10.2), so the list handed to `jax.shard_map` is filled in while `f` runs. Were
    a JAX release to read it earlier, it would fail loudly (a length mismatch), never
    silently.
    """
    out_specs: list[PartitionSpec] = []

    def body(*args: Any) -> list[Any]:
        specs, outs = f(*args)
        out_specs[:] = specs
        return list(outs)

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=axis_names,
        check_vma=check_vma,
    )


def detected_cluster() -> str | None:
    """The name of the cluster `jax.distributed.initialize()` would join with no
    arguments (Slurm, Open MPI, Kubernetes, Cloud TPU pods), or `None` if it finds none.

    The same detection JAX runs itself (opt-in methods such as mpi4py excluded, as JAX
    does), read from its cluster registry: JAX has no public way to ask.
    """
    from jax._src import clusters

    for env in clusters.ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return env.__name__
    return None


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


_Ref = getattr(jax, "Ref", None)  # public from jax 0.8
_AbstractRef = getattr(getattr(jax, "ref", None), "AbstractRef", None)


def is_ref(x: Any) -> bool:
    """Whether `x` is a mutable array (`jax.new_ref`), concrete or traced."""
    if _Ref is not None and isinstance(x, _Ref):
        return True
    return _AbstractRef is not None and isinstance(getattr(x, "aval", None), _AbstractRef)


def batched_leaves(leaves: list[Any]) -> tuple[list[Any], tuple[int | None, ...]] | None:
    """Under `jax.vmap`: each leaf as the batched program sees it, and its batch axis
    (`None`: not batched). `None` when no leaf is batched, or when the leaves are batched by
    different (nested) `vmap`s, whose combined program is not rebuilt here.

    Reads the `val` and `batch_dim` of JAX's batching tracers (and their `_trace`, to tell
    nested `vmap`s apart): private attributes, so anything unexpected gives `None`.
    """
    found, traces = [], set()
    for x in leaves:
        dim = getattr(x, "batch_dim", None) if is_tracer(x) else None
        val = getattr(x, "val", None) if is_tracer(x) else None
        if not isinstance(dim, int) or isinstance(dim, bool) or not hasattr(val, "shape"):
            found.append((x, None))
            continue
        traces.add(id(getattr(x, "_trace", None)))
        found.append((val, dim))
    if len(traces) != 1:
        return None
    return [v for v, _ in found], tuple(d for _, d in found)
