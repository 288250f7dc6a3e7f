"""`filter_jacfwd`, `filter_jacrev`, `filter_hessian`: Jacobians pushed a chunk of basis
vectors at a time through one `lax.fori_loop`, optionally split over a mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import Mesh

from .jacobian_program import _make


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

    `jax.jvp` of `fun` at `batch_size` input basis vectors per step of one
    `jax.lax.fori_loop`, as `jax.jacfwd` pushes all of them at once (so what it
    differentiates works here, `jax.custom_batching.custom_vmap` included). Works eagerly
    (compiled once per input shapes and statics, as `eqx.filter_jit` caches), under
    `jax.jit`, under `jax.vmap` and nested.

    **Arguments:**

    - `fun`: the function to differentiate, as for `filter_jacrev`.
    - `has_aux`: as for `filter_jacrev`.
    - `batch_size`: how many input basis vectors are pushed through `fun` at a time
        (`None`, an int `>= 1` or `"auto"`), as for `filter_jacrev`.
    - `memory_budget`: bytes per device for `batch_size="auto"`, as for `filter_jacrev`.
    - `mesh`: a `jax.sharding.Mesh` to split the input basis over, as for `filter_jacrev`;
        `None`: no splitting.
    - `axis`: the mesh axis name (or tuple of names) to split over; `None`: all of them.

    **Returns:**

    A function with the arguments of `fun`, returning the Jacobian as `eqx.filter_jacfwd`
    does (see `filter_jacrev`), each leaf in its output leaf's dtype and weak type (an
    integer output gives integer zeros). With `mesh`, the result is sharded along its input
    (last) dimensions. With `has_aux`, the pair `(jacobian, aux)`.

    **Raises:**

    - `TypeError`: as `filter_jacrev` does, for `fun`, `batch_size`, `memory_budget`, `mesh`
        and `axis` of the wrong type. When called: if a floating-point leaf of the first
        argument is complex (forward mode needs real inputs, as `jax.jacfwd` without
        `holomorphic`).
    - `ValueError`: as `filter_jacrev` does, for the values of `batch_size`,
        `memory_budget`, `mesh` and `axis` and for a first argument without a
        floating-point array leaf.

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

    - `fun`: the function to differentiate, as for `filter_jacrev`.
    - `has_aux`: if `True`, `fun` returns `(output, aux)` and the Hessian function returns
        `(hessian, aux)`.
    - `batch_size`: how many input basis vectors the outer forward pass pushes through at a
        time, as for `filter_jacfwd`.
    - `memory_budget`: bytes per device for `batch_size="auto"`, as for `filter_jacfwd`.
    - `mesh`: a `jax.sharding.Mesh` to split the outer pass's basis over, as for
        `filter_jacfwd`; `None`: no splitting.
    - `axis`: the mesh axis name (or tuple of names) to split over; `None`: all of them.

    **Returns:**

    A function with the arguments of `fun`, returning the Hessian as `eqx.filter_hessian`
    does: for a scalar `fun`, a PyTree of PyTrees, leaf `[i][j]` of shape
    `x_i.shape + x_j.shape`. With `has_aux`, the pair `(hessian, aux)`.

    **Raises:**

    - `TypeError`: as `filter_jacrev` does, for `fun`, `batch_size`, `memory_budget`, `mesh`
        and `axis` of the wrong type. When called: if a floating-point leaf of the first
        argument is complex, or an output leaf of `fun` is not real floating-point.
    - `ValueError`: as `filter_jacrev` does, for the values of `batch_size`,
        `memory_budget`, `mesh` and `axis` and for a first argument without a
        floating-point array leaf.

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
