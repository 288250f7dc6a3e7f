"""The program behind the Jacobian verbs: checking their options, building the basis
and pushing it through `f` in chunks (`basis.pushed`), optionally split over a mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.dtypes import float0
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from .. import _compat
from .._compat import tracing
from .._placement import committed
from .basis import one_hots, pushed
from .budget import AutoBatchSize, check_memory_budget
from .chunks import check_batch_size
from .jacobian_dtypes import check_inputs, check_outputs, like
from .programs import Programs
from .shared import Slot, shared


def _check_options(
    name: str, batch_size: Any, memory_budget: Any, mesh: Any, axis: Any
) -> tuple[str, ...]:
    """Checks the options; returns the mesh axes the basis is split over."""
    check_batch_size(
        batch_size, name, allow_auto=True, unit="basis vectors", none="all at once (Equinox's)"
    )
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


def _typed_like(v: Any, o: Any) -> Any:
    """The basis vector `v` typed as the output leaf `o` it is the cotangent of: laid out on
    the Explicit mesh axes `o`'s type names (`jax.vjp` takes no other type)."""
    s = _compat.traced_sharding(o)
    if s is None or s.mesh.empty or AxisType.Explicit not in tuple(s.mesh.axis_types):
        return v
    return _compat.reshard_explicit(v, s)


def _jacobian(
    fun: Callable,
    diff_x: Any,
    rev: bool,
    has_aux: bool,
    batch_size: int | None,
    mesh: Mesh | None,
    axes: tuple[str, ...],
) -> tuple[Any, Any]:
    """The Jacobian of `fun: diff_x -> (out, aux)` at `diff_x`, chunked; and `aux`.

    Reverse mode: one `jax.vjp`, its pullback applied to each chunk of output basis
    vectors. Forward mode: `jax.jvp` of each chunk of input basis vectors, as `jax.jacfwd`
    pushes them (so whatever `jax.jacfwd` differentiates works, `custom_vmap` included;
    `jax.linearize` needs more). The primal computation does not depend on the chunk, and
    XLA moves it out of the loop: about the flops and temporaries of one `linearize`
    (measured: equal on an MLP; +7% temporaries, -9% flops on the benchmark's scan).
    """
    # NumPy leaves as the arrays JAX makes of them (float64 is float32 without x64): the
    # basis is built in their dtype.
    diff_x = jtu.tree_map(jnp.asarray, diff_x)
    if rev:
        out, vjp_fun, aux = jax.vjp(fun, diff_x, has_aux=True)
        basis, other = out, diff_x

        def push(v: Any) -> Any:
            return vjp_fun(jtu.tree_map(_typed_like, v, out))[0]
    else:
        if has_aux:
            out, aux = fun(diff_x)  # `aux` once, outside the loop
        else:
            out, aux = jax.eval_shape(fun, diff_x)[0], None
        basis, other = diff_x, out

        def push(v: Any) -> Any:
            tangent = jax.jvp(lambda d: fun(d)[0], (diff_x,), (v,))[1]
            # An integer output's tangent is `float0`; its Jacobian is integer zeros.
            return jtu.tree_map(
                lambda t, o: jnp.zeros(t.shape, o.dtype) if t.dtype == float0 else t,
                tangent,
                out,
            )

    basis_leaves, basis_def = jtu.tree_flatten(basis)
    devices = 1 if mesh is None else math.prod(mesh.shape[a] for a in axes)

    def one(i: Any) -> Any:
        return push(one_hots(basis, i))

    split = None
    if mesh is not None:
        # On an Auto copy of the mesh: JAX's sharding types (Explicit axes) do not pass
        # through differentiated functions.
        split = NamedSharding(_auto_copy(mesh), P(axes))
    shapes = [tuple(b.shape) for b in basis_leaves]
    # For each basis leaf, a tree of the structure of `other` of its blocks. Reverse mode:
    # out-leaf (basis) shape first, then the in-leaf shape; forward mode: the out-leaf shape
    # first, then the basis (in-leaf) shape last. Each block in the dtype and weak type of
    # its input leaf (reverse) or output leaf (forward), as `jax.jac*` give them.
    pieces = pushed(one, shapes, batch_size, rev, split, devices)
    if rev:  # out-tree of in-trees
        pieces = [jtu.tree_map(like, p, other) for p in pieces]
        return jtu.tree_unflatten(basis_def, pieces), aux
    other_leaves, other_def = jtu.tree_flatten(other)
    per_out = [
        jtu.tree_unflatten(basis_def, [like(jtu.tree_leaves(p)[j], o) for p in pieces])
        for j, o in enumerate(other_leaves)
    ]
    return jtu.tree_unflatten(other_def, per_out), aux


def _run(jac: _Jac, batch_size: int | None, all_args: Any) -> tuple[Any, Any]:
    """`jac`'s Jacobian and aux at `all_args = (x, args, kwargs)`, `batch_size` at a time."""
    x, args, kwargs = all_args
    diff_x, static_x = eqx.partition(x, eqx.is_inexact_array)
    aux_static = []

    def f(diff: Any) -> Any:
        out = jac.fun(eqx.combine(diff, static_x), *args, **kwargs)
        out, aux = out if jac.has_aux else (out, None)
        if jac.rev:
            check_outputs(jac.name, out)
        aux, static = eqx.partition(aux, eqx.is_array)  # `jvp`/`vjp` take arrays only
        aux_static.append(static)
        return out, aux

    if jac.rev and not jtu.tree_leaves(diff_x):
        jax.eval_shape(f, diff_x)  # the output's dtypes are checked first, as `jax.jacrev` does
    check_inputs(jac.name, jac.rev, x)
    if batch_size is None and jac.mesh is None:  # exactly Equinox's program
        jacobian = jax.jacrev if jac.rev else jax.jacfwd
        out, aux = jacobian(f, has_aux=True)(diff_x)
    else:
        out, aux = _jacobian(f, diff_x, jac.rev, jac.has_aux, batch_size, jac.mesh, jac.axes)
    return out, eqx.combine(aux, *aux_static[-1:])


class _Jac(eqx.Module):
    fun: Callable
    has_aux: bool
    rev: bool
    batch_size: int | str | None
    mesh: Mesh | None
    axes: tuple[str, ...]
    auto: AutoBatchSize | None
    name: str
    programs: Programs  # the chunked program, compiled once per shapes for eager calls
    slot: Slot | None  # where shared `programs` find `fun` while they run (not holding it)

    def shared_key(self, fun_key: Callable[[Any], Any]) -> tuple:
        """This verb's key as the function of another (`filter_hessian`'s outer one)."""
        return (self.name, self.rev, fun_key(self.fun), self.has_aux, self.batch_size)

    def __call__(self, x: Any, /, *args: Any, **kwargs: Any) -> Any:
        all_args, me = (x, args, kwargs), self
        eager = self.mesh is not None and not tracing()
        if eager:
            assert self.mesh is not None
            # Arrays committed to other devices (one device, another mesh) are moved onto
            # the mesh whole, where `jit` over it would put uncommitted ones (it refuses
            # committed ones); traced leaves cannot move and are left to JAX. Then all run
            # on an Auto copy of the mesh (sharding types on Explicit axes do not pass
            # through differentiation): arrays on the mesh are handed over with no copy,
            # `fun`'s own arrays (a model's weights) too, and the results handed back.
            auto = _auto_copy(self.mesh)
            fun = committed.onto_mesh(self.name, self.fun, self.mesh)
            fun = committed.on_mesh(fun, auto)
            if fun is not self.fun:
                me = eqx.tree_at(lambda j: j.fun, self, fun)
            all_args = committed.onto_mesh(self.name, all_args, self.mesh)
            all_args = committed.on_mesh(all_args, auto)
        jac, aux = me._jacobian_at(all_args)
        if eager:
            assert self.mesh is not None
            jac, aux = committed.on_mesh((jac, aux), self.mesh)
        return (jac, aux) if self.has_aux else jac

    def _jacobian_at(self, all_args: Any) -> tuple[Any, Any]:
        if self.batch_size == "auto":
            assert self.auto is not None
            devices = 1 if self.mesh is None else math.prod(self.mesh.shape[a] for a in self.axes)

            def run(k: int, all_args: Any) -> Any:
                return _run(self, k, all_args)

            def n() -> int:
                return _basis_size(self.fun, self.rev, self.has_aux, all_args)

            batch_size = self.auto(run, all_args, n, devices)
        else:
            batch_size = self.batch_size
        assert not isinstance(batch_size, str)
        if (batch_size is None and self.mesh is None) or tracing():
            return _run(self, batch_size, all_args)  # inlined in what is being traced
        # Eager: one compiled program per statics and shapes, as `eqx.filter_jit`. The
        # programs (shared by the verbs of equal functions) see `fun` through the slot
        # only while they run, so that they keep neither it nor what it closes over.
        slot = self.slot
        if slot is None:  # programs of this verb's own: `fun`'s arrays are their inputs
            return self.programs(self, batch_size, all_args)
        me = eqx.tree_at(lambda j: j.fun, self, slot)
        slot.fun = self.fun
        try:
            return me.programs(me, batch_size, all_args)
        finally:
            slot.fun = None


def _auto_copy(mesh: Mesh) -> Mesh:
    """`mesh` with every axis Auto (the same devices and names)."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def _basis_size(fun: Callable, rev: bool, has_aux: bool, all_args: Any) -> int:
    """Number of basis vectors: output size (reverse mode) or input size (forward mode)."""
    x, args, kwargs = all_args
    if not rev:
        return sum(x.size for x in jtu.tree_leaves(eqx.filter(x, eqx.is_inexact_array)))
    out = eqx.filter_eval_shape(fun, x, *args, **kwargs)
    out = out[0] if has_aux else out
    return sum(math.prod(getattr(o, "shape", ())) for o in jtu.tree_leaves(out))


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
    key = (name, rev, fun, has_aux, batch_size, memory_budget, mesh, axes)
    programs, auto, slot = shared(key, _run)
    return _Jac(fun, has_aux, rev, batch_size, mesh, axes, auto, name, programs, slot)
