"""`filter_shard_map`: `jax.shard_map` for PyTrees with non-array leaves; the `pmap` successor."""

from __future__ import annotations

import functools as ft
from collections.abc import Callable, Set
from typing import Any

import equinox as eqx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding
from jaxtyping import PyTree

from .. import _compat
from .._placement import committed, place, targets
from .._placement.specs import check_specs
from .._tree import Flat, fun_optional, leaf_error, pathstr
from .axes import get_mesh, has_explicit, manual_axes
from .specs import check_out_specs, check_spec_values, scalars_as_arrays, specs_per_leaf

_VERB = "filter_shard_map"
Specs = PartitionSpec | PyTree[PartitionSpec | NamedSharding | None] | Callable[[Any, Any], Any]


_NOT_ARRAYS = (
    "Convert them to a numeric dtype (e.g. strings to integer codes), or give them to `fun` "
    "by closure or in a static field (`eqx.field(static=True)`)."
)


def _is_argument(x: Any) -> bool:
    """Array leaves, and mutable arrays (`jax.new_ref`): passed in, never closed over."""
    return eqx.is_array(x) or _compat.is_ref(x)


def _plain(spec: PartitionSpec) -> PartitionSpec:
    """`spec` without its `unreduced`/`reduced` sets: what the layout checks read."""
    return PartitionSpec(*_compat.spec_entries(spec))


def _layout(spec: PartitionSpec, mesh: Any, ndim: int) -> list[tuple[str, ...]]:
    """The mesh axes (of size > 1) splitting each dim: equal for equivalent specs."""
    sizes = dict(mesh.shape)
    entries = [*_compat.spec_entries(spec), *[None] * ndim][:ndim]
    out = []
    for entry in entries:
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        out.append(tuple(a for a in names if sizes.get(a, 1) > 1))
    return out


def _check_refs_laid_out(flat: Flat, specs: dict[int, PartitionSpec], mesh: Any) -> None:
    """A mutable array cannot be re-laid out (a copy would lose its writes): check it is."""
    rows = []
    for i, spec in specs.items():
        x = flat.leaves[i]
        if not _compat.is_ref(x):
            continue
        current = _compat.traced_sharding(x)  # a Ref's aval carries its layout
        if current is None:
            continue
        current_spec = current.spec
        ndim = len(x.shape)
        if _layout(spec, mesh, ndim) != _layout(current_spec, mesh, ndim):
            rows.append(
                (pathstr(flat.paths[i]), f"laid out as {current_spec}", f"`in_specs` {spec}")
            )
    if rows:
        raise ValueError(
            leaf_error(
                f"`{_VERB}` got mutable arrays (`jax.new_ref`) not laid out as `in_specs` say:",
                rows,
                "Create each Ref from an array already laid out as its in_spec "
                "(`jax.new_ref(filter_shard(x, mesh, spec))`), or give it that in_spec.",
            )
        )


def _call(
    fun: Callable,
    mesh: Any,
    in_specs: Any,
    out_specs: Any,
    axis_names: Set[str] | None,
    check_vma: bool,
    args: tuple,
    kwargs: dict,
) -> Any:
    if kwargs:
        raise TypeError(
            f"`{_VERB}` takes positional arguments only (as `jax.shard_map`); got keyword "
            f"arguments {sorted(kwargs)}. Pass them positionally, with their `in_specs`."
        )
    mesh = get_mesh(mesh)
    free = frozenset(mesh.axis_names) - _compat.vmapped_mesh_axes()
    manual = manual_axes(mesh, axis_names, free)
    flat = Flat(scalars_as_arrays(args, in_specs, "in_specs"), is_array=_is_argument)
    targets.check_dtypes(_VERB, flat, flat.array_indices, _NOT_ARRAYS)
    values = specs_per_leaf(flat, in_specs, mesh, "in_specs")
    specs = check_spec_values(flat, values, mesh, manual, "in_specs", none_ok=True)
    check_specs(_VERB, flat, {i: (mesh, _plain(spec)) for i, spec in specs.items()})
    if manual == free and has_explicit(mesh, manual):
        # Mapped over every (non-`vmap`) axis of an Explicit mesh, `jax.shard_map` requires
        # inputs already laid out as `in_specs` say; lay them out here (a transfer outside
        # `jit`, a reshard inside). With fewer `axis_names` JAX re-lays out the mapped axes
        # itself and keeps the others as they are: placing here would gather those.
        # Refs cannot be copied; specs with `unreduced`/`reduced` sets describe a type
        # (a pending or a replicated-for-reduction value) only JAX can give: both are
        # left for JAX to check.
        _check_refs_laid_out(flat, specs, mesh)
        shardings: dict[int, Sharding] = {
            i: NamedSharding(mesh, s)
            for i, s in specs.items()
            if not _compat.is_ref(flat.leaves[i]) and not _compat.spec_reductions(s)
        }
        placed = place.place(_VERB, flat, shardings)
        flat = Flat(flat.rebuild(placed), is_array=_is_argument)
    else:
        # `jit` over the mesh refuses arrays committed to other devices (one device, another
        # mesh): outside `jit` they are moved onto it as their in_specs say.
        shardings = {
            i: NamedSharding(mesh, specs[i])
            for i in committed.elsewhere(flat, mesh)
            if not _compat.spec_reductions(specs[i])
        }
        if shardings:
            placed = place.place(_VERB, flat, shardings)
            flat = Flat(flat.rebuild(placed), is_array=_is_argument)
    indices = flat.array_indices
    out_flat: list[Flat] = []

    def per_device(*local: Any) -> tuple[list[PartitionSpec], list[Any]]:
        out = fun(*flat.rebuild(dict(zip(indices, local, strict=True))))
        out_tree = Flat(scalars_as_arrays(out, out_specs, "out_specs"))
        out_values = specs_per_leaf(out_tree, out_specs, mesh, "out_specs")
        out_specs_flat = check_spec_values(
            out_tree, out_values, mesh, manual, "out_specs", none_ok=False
        )
        check_out_specs(out_tree, out_specs_flat, mesh)
        out_flat[:] = [out_tree]
        return [out_specs_flat[i] for i in out_tree.array_indices], [
            out_tree.leaves[i] for i in out_tree.array_indices
        ]

    per_device.__name__ = getattr(fun, "__name__", "fun")  # JAX's errors name the user's
    mapped = _compat.shard_map_specs_from_trace(
        per_device,
        mesh=mesh,
        in_specs=tuple(specs[i] for i in indices),
        axis_names=manual,
        check_vma=check_vma,
    )
    outs = mapped(*(flat.leaves[i] for i in indices))
    (out_tree,) = out_flat
    return out_tree.rebuild(dict(zip(out_tree.array_indices, outs, strict=True)))


@fun_optional()
def filter_shard_map(
    fun: Callable | None = None,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    in_specs: Specs,
    out_specs: Specs,
    axis_names: Set[str] | None = None,
    check_vma: bool = True,
) -> Any:
    """Maps `fun` over the shards of its array arguments, one call per device: `jax.shard_map`
    for PyTrees with non-array leaves, and the `pmap` replacement that composes with `jit`.

    Each device runs `fun` on its own block of every array leaf (as `in_specs` split
    them) and may talk to the others with collectives (`jax.lax.psum`, `ppermute`,
    `all_gather`, ...) over the mesh axis names. Non-array leaves of the arguments (an
    `eqx.Module`'s activation functions, ints, strings) are passed through to `fun`
    untouched; non-array leaves of the output are returned as they are (they are the
    same on every device by construction). Mutable arrays (`jax.new_ref`) are passed in
    like arrays, so `fun` can write to its shard of them. Works outside `jit` (like
    `jax.shard_map`, it then runs op by op: wrap the caller in `eqx.filter_jit` for
    speed) and inside `jit`, `grad` and `vmap` wherever `jax.shard_map` does. Inside
    `jit` the result stays sharded on the mesh: no copy to one device or the host,
    unlike `jit(pmap(f))`.

    It can be used as a decorator: `@filter_shard_map(mesh=..., in_specs=..., out_specs=...)`.

    **Arguments:**

    - `fun`: the per-device function. It is called with positional arguments only.
        Omit it to get a decorator.
    - `mesh`: the `jax.sharding.Mesh` (or `AbstractMesh`) to map over, with Auto or
        Explicit axes. `None` (default) uses the mesh set by `jax.set_mesh`.
    - `in_specs`: how each argument is split, as a prefix PyTree of the tuple of
        arguments. Its leaves are:
        - a `PartitionSpec`: split that subtree's array leaves as it says (mesh axis
            `'i'` at position `d` splits dim `d` over the devices of `'i'`);
        - `None`: for non-array leaves; on array leaves it means `P()` (the whole array
            on every device, like `in_axes=None` in `pmap`);
        - a `NamedSharding` on `mesh`: its spec.
        A `PartitionSpec` may carry `unreduced=`/`reduced=` sets, as in `jax.shard_map`.
        - a callable `(path, leaf) -> PartitionSpec | None` or a sharding rule (an
            object with a method `spec_for(path, leaf, mesh) -> PartitionSpec | None`,
            e.g. `fsdp`), called on each array leaf of that subtree with its path from
            the subtree; the whole `in_specs` may be one too.
    - `out_specs`: how the per-device outputs are joined, as a prefix PyTree of the
        output: a `PartitionSpec` concatenates the blocks along the named mesh axes (a
        mesh axis not named is a promise that the blocks are equal along it); `None`
        goes on non-array outputs. Callables `(path, leaf) -> PartitionSpec` and rules
        also work, alone or in the tree.
    - `axis_names`: the mesh axes `fun` is mapped over (manual); the others stay under
        the compiler's control, and inputs keep their layout along them. `None`
        (default): every mesh axis that no enclosing `jax.vmap` has taken for its batch
        dim (as `jax.shard_map`). On Explicit axes, when every such axis is mapped,
        array inputs are first laid out as `in_specs` say (`jax.shard_map` requires it);
        a mutable array cannot be copied, so it must already be laid out so. Outside
        `jit`, an array committed to other devices (one device, another mesh) is moved
        onto the mesh as its in_spec says (`jax.shard_map` raises there).
    - `check_vma`: `jax.shard_map`'s check that outputs said to be equal across devices
        are (and the matching autodiff optimisations). Default `True`.

    **Returns:**

    A function taking the same positional arguments as `fun` and returning the output
    of `fun` with every array output joined as `out_specs` say.

    **Raises:**

    - `ValueError`: naming every failing leaf by path, when `in_specs`/`out_specs` is not
        a prefix of the arguments/output; gives a `PartitionSpec` for a non-array leaf
        or `None` for an array output; names an axis the mesh lacks or one outside
        `axis_names`, uses an axis twice, has more entries than the leaf has dims, or
        splits a dim that does not divide evenly. Also when no `mesh` is given or set,
        `axis_names` names axes the mesh lacks or that an enclosing `vmap` has taken, or
        a mutable array is not laid out as its in_spec says on Explicit axes.
    - `TypeError`: for a spec that is not a `PartitionSpec`, a `mesh` that is not a mesh,
        keyword arguments in the call, or array arguments of a dtype JAX has no arrays of
        (NumPy strings, bytes, objects), naming each.

    Other errors (an output said to be equal across devices that is not, under
    `check_vma=True`) come from `jax.shard_map`.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P
        import eqxshard

        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("i",), axis_types=auto)
        model = eqx.nn.Linear(4, 4, key=jax.random.key(0))  # arrays and a static `use_bias`

        @eqx.filter_jit
        @eqxshard.filter_shard_map(mesh=mesh, in_specs=(P(), P("i")), out_specs=(P("i"), P()))
        def step(model, x):
            y = jax.vmap(model)(x)                            # this device's rows
            return y, jax.lax.pmean(jnp.mean(y**2), "i")      # and one global loss

        y, loss = step(model, jnp.ones((8 * jax.device_count(), 4)))
        ```
    """
    if not callable(fun):
        raise TypeError(f"`{_VERB}` needs a callable `fun`, got {type(fun).__name__}.")

    @ft.wraps(fun)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        return _call(fun, mesh, in_specs, out_specs, axis_names, check_vma, args, kwargs)

    return mapped
