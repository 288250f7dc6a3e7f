"""The program behind the Jacobian verbs: checking their options, building the basis
and pushing it through `f` in chunks (`basis.pushed`), optionally split over a mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from .basis import one_hots, pushed
from .budget import AutoBatchSize, check_memory_budget
from .chunks import check_batch_size


def _check_options(
    name: str, batch_size: Any, memory_budget: Any, mesh: Any, axis: Any
) -> tuple[str, ...]:
    """Checks the options; returns the mesh axes the basis is split over."""
    check_batch_size(batch_size, name, allow_auto=True)
    check_memory_budget(memory_budget, batch_size, name)
    if mesh is None:
        if axis is not None:
            raise ValueError(
                f"`{name}(axis={axis!r})` names mesh axes, but no `mesh` is given. "
                "Pass `mesh=` too, or drop `axis`."
            )
        return ()
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"`{name}(mesh=...)` must be a `jax.sharding.Mesh`, got {type(mesh).__name__}. "
            "Build one with `jax.make_mesh`."
        )
    axes = mesh.axis_names if axis is None else (axis,) if isinstance(axis, str) else axis
    if not isinstance(axes, Sequence) or not all(isinstance(a, str) for a in axes):
        raise TypeError(
            f"`{name}(axis=...)` must be a mesh axis name or a tuple of them, got {axis!r}."
        )
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown or len(set(axes)) != len(axes) or not axes:
        raise ValueError(
            f"`{name}(axis={axis!r})` must name distinct axes of the mesh, whose axes are "
            f"{mesh.axis_names}; unknown: {unknown}. Pick from those names, or leave `axis` "
            "out to use all of them."
        )
    devices = math.prod(mesh.shape[a] for a in axes)
    if isinstance(batch_size, int) and batch_size % devices:
        raise ValueError(
            f"`{name}(batch_size={batch_size})` is the number of basis vectors per chunk "
            f"across the mesh, so it must be a multiple of the {devices} devices of mesh "
            f"axes {tuple(axes)}. Pass e.g. `batch_size={devices * max(1, batch_size // devices)}`."
        )
    return tuple(axes)


def _jacobian(
    fun: Callable,
    diff_x: Any,
    rev: bool,
    batch_size: int | None,
    mesh: Mesh | None,
    axes: tuple[str, ...],
) -> tuple[Any, Any]:
    """The Jacobian of `fun: diff_x -> (out, aux)` at `diff_x`, chunked; and `aux`."""
    if rev:
        out, vjp_fun, aux = jax.vjp(fun, diff_x, has_aux=True)
        basis, other = out, diff_x

        def push(v: Any) -> Any:
            return vjp_fun(v)[0]
    else:
        out, push, aux = jax.linearize(fun, diff_x, has_aux=True)
        basis, other = diff_x, out
    basis_leaves, basis_def = jtu.tree_flatten(basis)
    devices = 1 if mesh is None else math.prod(mesh.shape[a] for a in axes)

    def one(i: Any) -> Any:
        return push(one_hots(basis, i))

    split = None
    if mesh is not None:
        # On an Auto copy of the mesh: JAX's sharding types (Explicit axes) do not pass
        # through `linearize`d functions.
        auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)
        split = NamedSharding(auto, P(axes))
    shapes = [tuple(b.shape) for b in basis_leaves]
    # For each basis leaf, a tree of the structure of `other` of its blocks. Reverse mode:
    # out-leaf (basis) shape first, then the in-leaf shape; forward mode: the out-leaf shape
    # first, then the basis (in-leaf) shape last.
    pieces = pushed(one, shapes, batch_size, rev, split, devices)
    if rev:  # out-tree of in-trees
        return jtu.tree_unflatten(basis_def, pieces), aux
    other_leaves, other_def = jtu.tree_flatten(other)
    per_out = [
        jtu.tree_unflatten(basis_def, [jtu.tree_leaves(p)[j] for p in pieces])
        for j in range(len(other_leaves))
    ]
    return jtu.tree_unflatten(other_def, per_out), aux


class _Jac(eqx.Module):
    fun: Callable
    has_aux: bool
    rev: bool
    batch_size: int | str | None
    mesh: Mesh | None
    axes: tuple[str, ...]
    auto: AutoBatchSize | None
    name: str

    def __call__(self, x: Any, /, *args: Any, **kwargs: Any) -> Any:
        def run(batch_size: int | None, all_args: Any) -> Any:
            x, args, kwargs = all_args
            diff_x, static_x = eqx.partition(x, eqx.is_inexact_array)

            aux_static = []

            def f(diff: Any) -> Any:
                out = self.fun(eqx.combine(diff, static_x), *args, **kwargs)
                if not self.has_aux:
                    return out, None
                out, aux = out
                aux, static = eqx.partition(aux, eqx.is_array)  # `linearize` takes arrays only
                aux_static.append(static)
                return out, aux

            if batch_size is None and self.mesh is None:  # exactly Equinox's program
                jacobian = jax.jacrev if self.rev else jax.jacfwd
                jac, aux = jacobian(f, has_aux=True)(diff_x)
            else:
                jac, aux = _jacobian(f, diff_x, self.rev, batch_size, self.mesh, self.axes)
            return jac, eqx.combine(aux, *aux_static[-1:])

        all_args = (x, args, kwargs)
        if self.batch_size == "auto":
            assert self.auto is not None
            n = _basis_size(self.fun, self.rev, self.has_aux, all_args)
            devices = 1 if self.mesh is None else math.prod(self.mesh.shape[a] for a in self.axes)
            batch_size = self.auto(run, all_args, n, devices)
        else:
            batch_size = self.batch_size
        jac, aux = run(batch_size, all_args)  # pyright: ignore[reportArgumentType]
        return (jac, aux) if self.has_aux else jac


def _basis_size(fun: Callable, rev: bool, has_aux: bool, all_args: Any) -> int:
    """Number of basis vectors: output size (reverse mode) or input size (forward mode)."""
    x, args, kwargs = all_args
    if not rev:
        return sum(x.size for x in jtu.tree_leaves(eqx.filter(x, eqx.is_inexact_array)))
    out = eqx.filter_eval_shape(fun, x, *args, **kwargs)
    out = out[0] if has_aux else out
    return sum(math.prod(o.shape) for o in jtu.tree_leaves(out))


def _make(
    name: str,
    rev: bool,
    fun: Callable,
    has_aux: bool,
    batch_size: Any,
    memory_budget: Any,
    mesh: Any,
    axis: Any,
) -> _Jac:
    if not callable(fun):
        raise TypeError(f"`{name}(fun)` must be callable, got {type(fun).__name__}.")
    axes = _check_options(name, batch_size, memory_budget, mesh, axis)
    auto = AutoBatchSize(name, memory_budget) if batch_size == "auto" else None
    return _Jac(fun, has_aux, rev, batch_size, mesh, axes, auto, name)
