"""`filter_jacfwd`, `filter_jacrev`, `filter_hessian`: Jacobians pushed a chunk of basis
vectors at a time through one `lax.fori_loop`, optionally split over a mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from ._basis import one_hots, pushed
from ._budget import AutoBatchSize, check_memory_budget
from ._mapping import check_batch_size


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


def filter_jacrev(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    batch_size: int | str | None = None,
    memory_budget: int | float | None = None,
    mesh: Mesh | None = None,
    axis: str | Sequence[str] | None = None,
) -> Callable[..., Any]:
    """Computes the Jacobian of `fun` with reverse-mode AD, a chunk of output basis
    vectors at a time: a drop-in for `eqx.filter_jacrev` whose memory is bounded.

    One forward pass, then `jax.vjp` of each row's basis vector, `batch_size` rows per step
    of one `jax.lax.fori_loop`. Works eagerly, under `jax.jit`, under
    `jax.vmap` (batched Jacobians) and nested (see `filter_hessian`).

    **Arguments:**

    - `fun`: the function to differentiate with respect to the array leaves of its first
        argument (floating-point arrays; other leaves are held fixed and left as they are).
    - `has_aux`: if `True`, `fun` returns `(output, aux)` and the Jacobian function returns
        `(jacobian, aux)`.
    - `batch_size`: how many basis vectors are pushed through `fun` at a time:
        - `None`: all at once, exactly as Equinox and JAX do (the same program);
        - an int `>= 1`: that many per step of a `jax.lax.fori_loop`, so memory is that of
            `batch_size` passes (with `mesh`: across the mesh, a multiple of its devices);
        - `"auto"`: the largest chunk whose compiled temporaries (per device, measured with
            `compiled.memory_analysis()`) fit `memory_budget`, found once per input shapes.
    - `memory_budget`: bytes per device for `batch_size="auto"`:
        - `None`: half of the device's memory as `device.memory_stats()["bytes_limit"]`
            reports it (CPU reports none: pass a number there);
        - a number of bytes `> 0`.
        Under `jax.vmap` the budget is for the whole batch: the search measures the
        vmapped program (of the innermost `vmap`, when they are nested).
    - `mesh`: a `jax.sharding.Mesh` to split the basis over: each basis leaf is cut along
        its first dimension that the number of devices divides, each device computes its
        own block of the Jacobian, and the result stays split along that dimension (no
        collectives; a leaf with no such dimension is cut flat and padded, and laying it
        out may take some). `None`: no splitting.
    - `axis`: the mesh axis name (or tuple of names) to split over; `None`: all of them.

    **Returns:**

    A function with the arguments of `fun`, returning the Jacobian as `eqx.filter_jacrev`
    does: a PyTree of the structure of `fun`'s output whose leaves are PyTrees of the
    structure of the first argument (non-differentiated leaves `None`), each leaf of shape
    `output_leaf.shape + input_leaf.shape`. With `has_aux`, the pair `(jacobian, aux)`.

    **Raises:**

    - `TypeError`: if `fun` is not callable; if `batch_size` is not `None`, an int or
        `"auto"`; if `memory_budget` is not a number; if `mesh` is not a `Mesh` or `axis`
        not axis names.
    - `ValueError`: if `batch_size <= 0`; if `memory_budget <= 0` or is given without
        `batch_size="auto"`; if `axis` names axes the mesh does not have, or is given
        without `mesh`; if an int `batch_size` is not a multiple of the mesh's devices;
        with `batch_size="auto"`, if no memory budget is known (CPU without
        `memory_budget`) or if even one basis vector at a time does not fit (the error
        says how many bytes the smallest chunk needs).

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import eqxshard

        def f(params, x):
            return jnp.tanh(params["w"] @ x + params["b"])

        params = {"w": jnp.ones((64, 32)), "b": jnp.zeros(64)}
        jac = eqxshard.filter_jacrev(f, batch_size=8)(params, jnp.ones(32))
        assert jac["w"].shape == (64, 64, 32)  # 8 rows at a time, 8 steps
        ```
    """
    return _make("filter_jacrev", True, fun, has_aux, batch_size, memory_budget, mesh, axis)


def filter_jacfwd(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    batch_size: int | str | None = None,
    memory_budget: int | float | None = None,
    mesh: Mesh | None = None,
    axis: str | Sequence[str] | None = None,
) -> Callable[..., Any]:
    """Computes the Jacobian of `fun` with forward-mode AD, a chunk of input basis
    vectors at a time: a drop-in for `eqx.filter_jacfwd` whose memory is bounded.

    One `jax.linearize` of `fun`, then its tangent map applied to `batch_size` input basis
    vectors per step of one `jax.lax.fori_loop`. Works eagerly, under
    `jax.jit`, under `jax.vmap` and nested.

    **Arguments:**

    - `fun`: the function to differentiate with respect to the array leaves of its first
        argument (floating-point arrays; other leaves are held fixed and left as they are).
    - `has_aux`: if `True`, `fun` returns `(output, aux)` and the Jacobian function returns
        `(jacobian, aux)`.
    - `batch_size`: how many basis vectors are pushed through `fun` at a time:
        - `None`: all at once, exactly as Equinox and JAX do (the same program);
        - an int `>= 1`: that many per step of a `jax.lax.fori_loop`, so memory is that of
            `batch_size` passes (with `mesh`: across the mesh, a multiple of its devices);
        - `"auto"`: the largest chunk whose compiled temporaries (per device, measured with
            `compiled.memory_analysis()`) fit `memory_budget`, found once per input shapes.
    - `memory_budget`: bytes per device for `batch_size="auto"`:
        - `None`: half of the device's memory as `device.memory_stats()["bytes_limit"]`
            reports it (CPU reports none: pass a number there);
        - a number of bytes `> 0`.
        Under `jax.vmap` the budget is for the whole batch: the search measures the
        vmapped program (of the innermost `vmap`, when they are nested).
    - `mesh`: a `jax.sharding.Mesh` to split the basis over: each basis leaf is cut along
        its first dimension that the number of devices divides, each device computes its
        own block of the Jacobian, and the result stays split along that dimension (no
        collectives; a leaf with no such dimension is cut flat and padded, and laying it
        out may take some). `None`: no splitting.
    - `axis`: the mesh axis name (or tuple of names) to split over; `None`: all of them.

    **Returns:**

    A function with the arguments of `fun`, returning the Jacobian as `eqx.filter_jacfwd`
    does (see `filter_jacrev`). With `mesh`, the result is sharded along its input (last)
    dimensions. With `has_aux`, the pair `(jacobian, aux)`.

    **Raises:**

    - `TypeError`: if `fun` is not callable; if `batch_size` is not `None`, an int or
        `"auto"`; if `memory_budget` is not a number; if `mesh` is not a `Mesh` or `axis`
        not axis names.
    - `ValueError`: if `batch_size <= 0`; if `memory_budget <= 0` or is given without
        `batch_size="auto"`; if `axis` names axes the mesh does not have, or is given
        without `mesh`; if an int `batch_size` is not a multiple of the mesh's devices;
        with `batch_size="auto"`, if no memory budget is known (CPU without
        `memory_budget`) or if even one basis vector at a time does not fit (the error
        says how many bytes the smallest chunk needs).

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import eqxshard

        mesh = jax.make_mesh((8,), ("basis",))

        def f(x):
            return jnp.cumsum(jnp.sin(x))

        jac = eqxshard.filter_jacfwd(f, batch_size="auto", memory_budget=2**20, mesh=mesh)
        j = jac(jnp.linspace(0, 1, 256))  # columns split over the 8 devices
        assert j.shape == (256, 256)
        ```
    """
    return _make("filter_jacfwd", False, fun, has_aux, batch_size, memory_budget, mesh, axis)


def filter_hessian(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    batch_size: int | str | None = None,
    memory_budget: int | float | None = None,
    mesh: Mesh | None = None,
    axis: str | Sequence[str] | None = None,
) -> Callable[..., Any]:
    """Computes the Hessian of `fun` as forward-over-reverse AD, chunking the outer
    (forward) map: a drop-in for `eqx.filter_hessian` whose memory is bounded.

    The inner reverse pass runs at once (one row for a scalar `fun`); `batch_size`,
    `memory_budget`, `mesh` and `axis` apply to the outer forward pass over the input
    basis, as in `filter_jacfwd`.

    **Arguments:**

    - `fun`: the function to differentiate with respect to the array leaves of its first
        argument (floating-point arrays; other leaves are held fixed and left as they are).
    - `has_aux`: if `True`, `fun` returns `(output, aux)` and the Jacobian function returns
        `(jacobian, aux)`.
    - `batch_size`: how many basis vectors are pushed through `fun` at a time:
        - `None`: all at once, exactly as Equinox and JAX do (the same program);
        - an int `>= 1`: that many per step of a `jax.lax.fori_loop`, so memory is that of
            `batch_size` passes (with `mesh`: across the mesh, a multiple of its devices);
        - `"auto"`: the largest chunk whose compiled temporaries (per device, measured with
            `compiled.memory_analysis()`) fit `memory_budget`, found once per input shapes.
    - `memory_budget`: bytes per device for `batch_size="auto"`:
        - `None`: half of the device's memory as `device.memory_stats()["bytes_limit"]`
            reports it (CPU reports none: pass a number there);
        - a number of bytes `> 0`.
        Under `jax.vmap` the budget is for the whole batch: the search measures the
        vmapped program (of the innermost `vmap`, when they are nested).
    - `mesh`: a `jax.sharding.Mesh` to split the basis over: each basis leaf is cut along
        its first dimension that the number of devices divides, each device computes its
        own block of the Jacobian, and the result stays split along that dimension (no
        collectives; a leaf with no such dimension is cut flat and padded, and laying it
        out may take some). `None`: no splitting.
    - `axis`: the mesh axis name (or tuple of names) to split over; `None`: all of them.

    **Returns:**

    A function with the arguments of `fun`, returning the Hessian as `eqx.filter_hessian`
    does: for a scalar `fun`, a PyTree of PyTrees, leaf `[i][j]` of shape
    `x_i.shape + x_j.shape`. With `has_aux`, the pair `(hessian, aux)`.

    **Raises:**

    - `TypeError`: if `fun` is not callable; if `batch_size` is not `None`, an int or
        `"auto"`; if `memory_budget` is not a number; if `mesh` is not a `Mesh` or `axis`
        not axis names.
    - `ValueError`: if `batch_size <= 0`; if `memory_budget <= 0` or is given without
        `batch_size="auto"`; if `axis` names axes the mesh does not have, or is given
        without `mesh`; if an int `batch_size` is not a multiple of the mesh's devices;
        with `batch_size="auto"`, if no memory budget is known (CPU without
        `memory_budget`) or if even one basis vector at a time does not fit (the error
        says how many bytes the smallest chunk needs).

    !!! Example

        ```python
        import jax.numpy as jnp
        import eqxshard

        def energy(x):
            return jnp.sum(jnp.sin(x) ** 2)

        hess = eqxshard.filter_hessian(energy, batch_size=4)(jnp.arange(10.0))
        assert hess.shape == (10, 10)
        ```
    """
    inner = _make("filter_hessian", True, fun, has_aux, None, None, None, None)
    return _make("filter_hessian", False, inner, has_aux, batch_size, memory_budget, mesh, axis)
