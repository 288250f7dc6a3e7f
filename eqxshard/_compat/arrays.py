"""Arrays and tracers: what is traced, traced shardings and memory spaces, reshards,
PRNG keys, refs, and the batching tracers under `vmap`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .meshes import abstract_mesh_of, context_abstract_mesh

Tracer = jax.core.Tracer  # pyright: ignore[reportAttributeAccessIssue]


def device_assignment(sharding: jax.sharding.Sharding) -> tuple[Any, ...]:
    """The devices of `sharding` in the order `jit` compares them: the committed arguments
    of one computation must all have this same tuple (and equal the context mesh's)."""
    return tuple(sharding._device_assignment)  # pyright: ignore[reportAttributeAccessIssue]


def is_tracer(x: Any) -> bool:
    """Whether `x` is being traced (by `jit`, `vmap`, `grad`, `eval_shape`, ...).

    Decided per leaf, never by a global probe: a probe such as
    `isinstance(jnp.zeros(()), Tracer)` is wrong under `vmap`/`grad` without `jit`.
    """
    return isinstance(x, Tracer)


def traced_origin(x: Any) -> Any:
    """The value `x` was traced from, through the differentiation and batching tracers
    wrapped around it (`grad`'s primal, `vmap`'s value): under `jax.grad` a leaf seen
    inside the differentiated function is, after this, the very tracer of the argument."""
    while True:
        for name in ("primal", "val"):
            inner = getattr(x, name, None)
            if isinstance(x, Tracer) and isinstance(inner, Tracer):
                x = inner
                break
        else:
            return x


def traced_sharding(x: Any) -> jax.sharding.NamedSharding | None:
    """The sharding JAX attaches to a tracer's abstract value, if it has one."""
    aval = getattr(x, "aval", None)
    sharding = getattr(aval, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    return None


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


def astype_weak(x: Any, dtype: Any, weak_type: bool) -> Any:
    """`x` converted to `dtype`, weakly typed if `weak_type` (as `jax.jacfwd` returns the
    Jacobian of a weakly typed output). `jax.lax.convert_element_type` always gives a
    strong type; JAX's own conversion with `weak_type` is private. A JAX without it gets
    the strong type."""
    try:
        from jax._src.lax.lax import _convert_element_type
    except ImportError:  # pragma: no cover - a JAX that moved it
        return jax.lax.convert_element_type(x, dtype)
    return _convert_element_type(x, np.dtype(dtype), weak_type)


def with_sharding(x: jax.Array, sharding: Any) -> jax.Array:
    """The very buffers of `x` under `sharding`, an equivalent layout (the same devices and
    index per device, e.g. the same mesh with other axis types), keeping `x`'s weak type:
    no copy. `jax.make_array_from_single_device_arrays` makes every array strongly typed;
    a weakly typed one is rebuilt with JAX's private constructor."""
    shards = [shard.data for shard in x.addressable_shards]
    out = jax.make_array_from_single_device_arrays(x.shape, sharding, shards)
    if not getattr(x, "weak_type", False):
        return out
    from jax._src import array

    aval = out.aval.update(weak_type=True)  # pyright: ignore[reportAttributeAccessIssue]
    return array.ArrayImpl(aval, sharding, out._arrays, committed=True)  # pyright: ignore


def tracing() -> bool:
    """Whether a transformation (`jit`, `vmap`, `grad`, ...) is tracing right now.

    Only for what cannot happen while tracing at all, such as a cross-process collective
    on host data (`process_allgather` refuses to run inside `jit`); placement itself is
    decided per leaf (`is_tracer`).
    """
    from jax._src import core

    return not core.trace_state_clean()


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

    body.__name__ = body.__qualname__ = getattr(f, "__name__", "body")  # for JAX's errors
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=axis_names,
        check_vma=check_vma,
    )


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


def vmap_batching(leaves: list[Any]) -> str:
    """How an enclosing `jax.vmap` batches `leaves`, as a `custom_vmap` rule would see it.

    `"innermost"`: some leaf is a batching tracer of the transformation running now, so a
    `jax.custom_batching.custom_vmap` function called on it gets its rule called with the
    whole batch. `"beneath"`: some leaf carries a `vmap`'s batch only beneath another
    transformation that runs first (`jax.grad` inside `jax.vmap`), where a `custom_vmap`
    function cannot be differentiated. `"staged"`: no leaf is batched, but the function is
    being traced on its own (by `jax.jit`, `jax.checkpoint`, a `lax.scan` body, ...) inside
    a `vmap`, which batches the traced program afterwards: the leaves are one example
    of a batch nobody here can see. `"none"`: no leaf is batched, and no `vmap` waits.

    Reads JAX's current trace, its chain of `parent_trace`s, and its tracers' `_trace`,
    `val`, `batch_dim` and `primal`: private, so anything unexpected reads as not batched.
    """
    from jax._src import core  # private: the trace running now

    current = getattr(getattr(core, "trace_ctx", None), "trace", None)
    state = "none"
    for x in leaves:
        for _ in range(32):  # the nesting depth of transformations; a bound, not a limit
            if not is_tracer(x):
                break
            dim = getattr(x, "batch_dim", None)
            if isinstance(dim, int) and not isinstance(dim, bool):
                if current is not None and getattr(x, "_trace", None) is current:
                    return "innermost"
                state = "beneath"
                x = getattr(x, "val", None)
            else:
                x = getattr(x, "primal", None)
    if state == "none":
        trace, staged = current, False
        for _ in range(64):  # the nesting depth of traces; a bound, not a limit
            if trace is None:
                break
            if hasattr(trace, "frame"):  # a trace that builds a jaxpr to run later
                staged = True
            elif staged and hasattr(trace, "axis_data"):  # a `vmap`'s trace above it
                return "staged"
            trace = getattr(trace, "parent_trace", None)
    return state


def to_varying(x: Any, axis: str) -> Any:
    """`x` marked as varying over the manual mesh axis `axis` inside `shard_map`, so that it
    can start a `scan` carry that collectives make varying: `jax.lax.pcast(x, (axis,),
    to="varying")` from jax 0.8, `jax.lax.pvary(x, (axis,))` before it."""
    pcast = getattr(jax.lax, "pcast", None)
    if pcast is not None:
        return pcast(x, (axis,), to="varying")
    return jax.lax.pvary(x, (axis,))  # pyright: ignore[reportAttributeAccessIssue]
