"""`filter_jacfwd`, `filter_jacrev`, `filter_hessian`: Jacobians pushed a chunk of basis
vectors at a time through one `lax.fori_loop`, optionally split over a mesh.

The three verbs, made by one `_verb` from the signature they share (the API page documents
them from the imported functions: docs/griffe_made_functions.py); then the program they
share (`_make`): the options checked, the basis pushed in chunks (`basis.py`), the
programs compiled once per function and options (`shared.py`), and the dtypes of the
result (`jacobian_dtypes.py`).
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


def _verb(name: str, doc: str):  # its return type (the verb, signature included) inferred
    """The verb `name` (`filter_jacrev`, `filter_jacfwd` or `filter_hessian`) with `doc`:
    the three take the same options, written once here."""

    def verb(
        fun: Callable[..., Any],
        *,
        has_aux: bool = False,
        batch_size: int | str | None = None,
        memory_budget: int | float | None = None,
        mesh: Mesh | None = None,
        axis: str | Sequence[str] | None = None,
    ) -> Callable[..., Any]:
        if name == "filter_hessian":  # forward over reverse: the inner pass at once
            fun = _make(name, True, fun, has_aux, None, None, None, None)
        rev = name == "filter_jacrev"
        return _make(name, rev, fun, has_aux, batch_size, memory_budget, mesh, axis)

    verb.__name__ = verb.__qualname__ = name
    verb.__doc__ = doc
    return verb


filter_jacrev = _verb(
    "filter_jacrev",
    """Computes the Jacobian of `fun` with reverse-mode AD, a chunk of output basis
    vectors at a time: a drop-in for `eqx.filter_jacrev` whose memory is bounded.

    One forward pass, then `jax.vjp` of each row's basis vector, `batch_size` rows per step
    of one `jax.lax.fori_loop`. Works eagerly (compiled once per input shapes and statics,
    as `eqx.filter_jit` caches), under `jax.jit`, under `jax.vmap` (batched Jacobians) and
    nested (see `filter_hessian`).

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
        - a finite number of bytes `> 0`.
        Under `jax.vmap` the budget is for the whole batch: the search measures the
        vmapped program (of the innermost `vmap`, when they are nested).
    - `mesh`: a `jax.sharding.Mesh` to split the basis over: each basis leaf is cut along
        its first dimension that the number of devices divides, each device computes its
        own block of the Jacobian, and the result stays split along that dimension (no
        collectives; a leaf with no such dimension is cut flat and padded, and laying it
        out may take some). Outside `jit`, arrays committed to other devices (one device,
        another mesh) are first moved onto the mesh whole, where `jit` puts uncommitted
        ones. `None`: no splitting.
    - `axis`: the mesh axis name (or tuple of names) to split over; `None`: all of them.

    **Returns:**

    A function with the arguments of `fun`, returning the Jacobian as `eqx.filter_jacrev`
    does: a PyTree of the structure of `fun`'s output whose leaves are PyTrees of the
    structure of the first argument (non-differentiated leaves `None`), each leaf of shape
    `output_leaf.shape + input_leaf.shape`, in its input leaf's dtype and weak type (as
    `eqx.filter_jacrev`). With `has_aux`, the pair `(jacobian, aux)`.

    **Raises:**

    - `TypeError`: if `fun` is not callable; if `batch_size` is not `None`, an int or
        `"auto"`; if `memory_budget` is not a number; if `mesh` is not a `Mesh` or `axis`
        not axis names. When called: if an output leaf is complex or integer (reverse mode needs
        real floating-point outputs, as `jax.jacrev` without `holomorphic`).
    - `ValueError`: if `batch_size <= 0`; if `memory_budget` is not a finite number > 0,
        or is given without `batch_size="auto"`; if `axis` names axes the mesh does not
        have, or is given without `mesh`; if an int `batch_size` is not a multiple of the
        mesh's devices; with `batch_size="auto"`, if no memory budget is known (CPU without
        `memory_budget`) or if even one basis vector at a time does not fit (the error
        says how many bytes the smallest chunk needs). When called: if the first argument
        has no floating-point array leaf (nothing to differentiate).

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
    """,
)


filter_jacfwd = _verb(
    "filter_jacfwd",
    """Computes the Jacobian of `fun` with forward-mode AD, a chunk of input basis
    vectors at a time: a drop-in for `eqx.filter_jacfwd` whose memory is bounded.

    `jax.jvp` of `fun` at `batch_size` input basis vectors per step of one
    `jax.lax.fori_loop`, as `jax.jacfwd` pushes all of them at once (so what it
    differentiates works here, `jax.custom_batching.custom_vmap` included). Works eagerly
    (compiled once per input shapes and statics, as `eqx.filter_jit` caches), under
    `jax.jit`, under `jax.vmap` and nested.

    **Arguments:**

    - `fun`, `has_aux`: as for `filter_jacrev`.
    - `batch_size`: how many input basis vectors (columns of the Jacobian) go through
        `fun` per step: `None`, an int `>= 1` or `"auto"`, read as by `filter_jacrev`.
    - `memory_budget`, `mesh`, `axis`: as for `filter_jacrev`, `mesh` splitting the input
        basis (`None`: no splitting).

    **Returns:**

    A function with the arguments of `fun`, returning the Jacobian as `eqx.filter_jacfwd`
    does (see `filter_jacrev`), each leaf in its output leaf's dtype and weak type (an
    integer output gives integer zeros). With `mesh`, the result is sharded along its input
    (last) dimensions. With `has_aux`, the pair `(jacobian, aux)`.

    **Raises:**

    - `TypeError`: the errors of `filter_jacrev` for options of the wrong type; when
        called, if a floating-point leaf of the first argument is complex (forward mode
        needs real inputs, as `jax.jacfwd` without `holomorphic`).
    - `ValueError`: the errors of `filter_jacrev` for option values, and for a first
        argument without a floating-point array leaf.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import eqxshard

        mesh = jax.make_mesh((8,), ("basis",), axis_types=(jax.sharding.AxisType.Auto,))

        def f(x):
            return jnp.cumsum(jnp.sin(x))

        jac = eqxshard.filter_jacfwd(f, batch_size="auto", memory_budget=2**20, mesh=mesh)
        j = jac(jnp.linspace(0, 1, 256))  # columns split over the 8 devices
        assert j.shape == (256, 256)
        ```
    """,
)


filter_hessian = _verb(
    "filter_hessian",
    """Computes the Hessian of `fun` as forward-over-reverse AD, chunking the outer
    (forward) map: a drop-in for `eqx.filter_hessian` whose memory is bounded.

    The inner reverse pass runs at once (one row for a scalar `fun`); `batch_size`,
    `memory_budget`, `mesh` and `axis` apply to the outer forward pass over the input
    basis, as in `filter_jacfwd`.

    **Arguments:**

    - `fun`: the function to differentiate, as for `filter_jacrev`.
    - `has_aux`: if `True`, `fun` returns `(output, aux)` and the Hessian function returns
        `(hessian, aux)`.
    - `batch_size`, `memory_budget`, `mesh`, `axis`: of the outer forward pass over the
        input basis, as for `filter_jacfwd`.

    **Returns:**

    A function with the arguments of `fun`, returning the Hessian as `eqx.filter_hessian`
    does: for a scalar `fun`, a PyTree of PyTrees, leaf `[i][j]` of shape
    `x_i.shape + x_j.shape`. With `has_aux`, the pair `(hessian, aux)`.

    **Raises:**

    - `TypeError`: those of `filter_jacfwd`, and when called, if an output leaf of `fun`
        is not real floating-point.
    - `ValueError`: those of `filter_jacfwd`.

    !!! Example

        ```python
        import jax.numpy as jnp
        import eqxshard

        def energy(x):
            return jnp.sum(jnp.sin(x) ** 2)

        hess = eqxshard.filter_hessian(energy, batch_size=4)(jnp.arange(10.0))
        assert hess.shape == (10, 10)
        ```
    """,
)


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
