"""The only place that touches private or version-specific JAX API.

Everything here is small on purpose: when JAX moves an API, this folder is what to fix.
Supported: jax 0.7.2 (the lowest, tested in CI) to the newest release. The rest of
eqxshard reads these names as `_compat.name`; each submodule holds one family:
`arrays` (tracers, traced shardings, memory kinds, PRNG keys, refs, batching tracers,
varying values in `shard_map`),
`meshes` (ambient and abstract meshes, axis types, specs), `nested` (a `shard_map`
nested in another whose backward pass lowers), `processes` (host gathers,
global shapes, the detected cluster, the coordination-service client),
`equinox_errors` (Equinox's private state for `eqx.error_if` messages, which
`filter_jit` reports as `eqx.filter_jit` does), `jaxprs` (a `scan` equation's
constants and carries) and `compile` (compiling a module lowered
on an `AbstractMesh` on as many CPU devices).

Imports: JAX (and Equinox, in `equinox_errors`) only; nothing else of eqxshard.
"""

from .arrays import (
    TRACED_MEMORY_KINDS as TRACED_MEMORY_KINDS,
    Tracer as Tracer,
    astype_weak as astype_weak,
    batched_leaves as batched_leaves,
    device_assignment as device_assignment,
    is_jax_dtype as is_jax_dtype,
    is_prng_key as is_prng_key,
    is_ref as is_ref,
    is_tracer as is_tracer,
    memory_kinds_in_jit as memory_kinds_in_jit,
    memory_space as memory_space,
    reshard_explicit as reshard_explicit,
    shard_map_specs_from_trace as shard_map_specs_from_trace,
    to_varying as to_varying,
    traced_memory_space as traced_memory_space,
    traced_origin as traced_origin,
    traced_sharding as traced_sharding,
    tracing as tracing,
    vmap_batching as vmap_batching,
    with_sharding as with_sharding,
)
from .compile import compile_stablehlo as compile_stablehlo
from .equinox_errors import equinox_runtime_error as equinox_runtime_error
from .jaxprs import scan_counts as scan_counts
from .meshes import (
    abstract_mesh as abstract_mesh,
    abstract_mesh_of as abstract_mesh_of,
    ambient_mesh as ambient_mesh,
    axis_type_map as axis_type_map,
    context_abstract_mesh as context_abstract_mesh,
    is_sharding_type_error as is_sharding_type_error,
    manual_axes_here as manual_axes_here,
    mesh_platform as mesh_platform,
    nested_mesh as nested_mesh,
    spec_entries as spec_entries,
    spec_reductions as spec_reductions,
    spec_str as spec_str,
    tracing_on as tracing_on,
    vmapped_mesh_axes as vmapped_mesh_axes,
)
from .nested import nested_shard_map as nested_shard_map
from .processes import (
    coordination_client as coordination_client,
    detected_cluster as detected_cluster,
    global_shape as global_shape,
    process_allgather as process_allgather,
    use_gloo_address as use_gloo_address,
)
