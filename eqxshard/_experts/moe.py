"""`moe`: a mixture-of-experts layer's experts run where they live, each token's
activations sent to its experts' devices and back (`dispatch`), as one program per
signature (kept across calls, so that an eager call does not run op by op)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .. import _compat
from .._caches import register
from .checks import Problem, check
from .dispatch import dispatch

_PROGRAMS: dict[Any, Callable[..., Any]] = {}


@register
def _clear() -> None:
    _PROGRAMS.clear()


def _build(expert: Callable[..., Any], static: Any, p: Problem) -> Callable[..., Any]:
    tokens = PartitionSpec(p.token_axes)

    def body(params: Any, x: Any, indices: Any, weights: Any) -> Any:
        return dispatch(expert, eqx.combine(params, static), x, indices, weights, p)

    def run(params: Any, x: Any, indices: Any, weights: Any) -> Any:
        specs = jax.tree.map(lambda _: PartitionSpec(p.axis), params)
        if AxisType.Explicit in _compat.axis_type_map(p.mesh).values():
            # Explicit axes: each input laid out as `shard_map` takes it (for inputs
            # already so, nothing moves; for replicated ones, a local slice).
            def to(a: Any, spec: PartitionSpec) -> Any:
                return _compat.reshard_explicit(a, NamedSharding(p.mesh, spec))

            params = jax.tree.map(to, params, specs)
            x, indices, weights = (to(a, tokens) for a in (x, indices, weights))
        # Nested in a pipeline's `shard_map` over its stage axis, its backward pass
        # recomputes the dispatch (`_compat.nested_shard_map` says why).
        mapped = _compat.nested_shard_map(
            body,
            mesh=p.mesh,
            in_specs=(specs, tokens, tokens, tokens),
            out_specs=(tokens, PartitionSpec()),
            axis_names=frozenset(p.token_axes),
            check_vma=True,
        )
        return mapped(params, x, indices, weights)

    return jax.jit(run)


def _program(expert: Callable[..., Any], static: Any, p: Problem) -> Callable[..., Any]:
    """The jitted program for this signature, built once (`static`: the non-array part of
    the experts, which the program closes over)."""
    leaves, treedef = jax.tree_util.tree_flatten(static)
    try:
        key = (expert, treedef, tuple(leaves), p)
        hash(key)
    except TypeError:  # an unhashable non-array leaf: built afresh, not kept
        return _build(expert, static, p)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = _build(expert, static, p)
    return _PROGRAMS[key]


def moe(
    expert: Callable[[Any, jax.Array], jax.Array],
    experts: Any,
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    *,
    mesh: Any = None,
    axis: str = "expert",
    data_axes: str | tuple[str, ...] | None = None,
    capacity_factor: float | None = None,
    return_dropped: bool = False,
) -> Any:
    """A mixture-of-experts layer's experts, each on the devices that hold it.

    Computes, for every token `n`,
    `y[n] = sum_j weights[n, j] * expert(experts[indices[n, j]], x[n])`: the same values
    (float32 summation order aside) and gradients (with respect to `experts`, `x` and
    `weights`) as that sum computed densely on one device. The experts are laid out over
    mesh axis `axis` (each device holds `E/A` of them and never gathers the others) and
    the tokens over `data_axes` and `axis`; each device sends each of its tokens'
    activations to the devices of the token's experts and gets the outputs back (two
    `all_to_all`s over `axis`, inside `jax.shard_map`). The output keeps the tokens' split.
    The router is the model's own: `indices` and `weights` are its choices.

    Inside a `shard_map` already Manual over `axis` (`filter_shard_map` over `("data",
    "expert")`), each device passes its own `E/A` experts and its own tokens (`x`,
    `indices`, `weights` its rows) and gets its tokens' outputs: the dispatch runs there,
    with no `shard_map` of this function's own.

    Works eagerly and inside `jax.jit`/`filter_jit`, `jax.grad`, `lax.scan` (a `Stacked`
    of MoE layers) and a pipeline's stage (a `Stacked` with a stage axis, whose backward
    pass then runs the dispatch and the experts again: JAX cannot keep a nested
    `shard_map`'s residuals); an eager call runs one compiled program, kept for later calls with the
    same signature (emptied by `eqxshard.clear_caches`).

    With `capacity_factor=None` every assignment is computed (dropless): each device sends
    each other one buffer of `n_local * k` rows (the most its `n_local` tokens could send
    one device) and runs each of its local experts on every row it receives, which costs
    `A * n_local * k` rows of memory per device and `E/A` times the expert work of those
    rows; it needs no `ragged_all_to_all`, so it runs on every backend. With
    `capacity_factor=c`, GShard's rule: among the tokens one device holds, each expert
    takes at most `ceil(c * n_local * k / E)` assignments, in order of tokens, then of
    each token's choices; the rest contribute nothing (their weight is lost, not
    renormalised). Each expert then runs on its own rows only.

    **Arguments:**

    - `expert`: `expert(block, h) -> out`, one expert (`block`, one slice of `experts`)
        on a batch of tokens `h` of shape `(m, D)`, giving `(m, D_out)`. For experts that
        are Equinox modules applying to one token, `lambda block, h: jax.vmap(block)(h)`.
    - `experts`: a PyTree whose array leaves share a leading expert dim `E`, e.g.
        `eqx.filter_vmap(make_expert)(jax.random.split(key, E))`; its non-array leaves
        are shared by every expert.
    - `x`: the tokens, shape `(N, D)`.
    - `indices`: integers of shape `(N, k)`, each token's `k` experts (in `[0, E)`).
    - `weights`: shape `(N, k)`, the combine weight of each choice.
    - `mesh`: the mesh; `None` uses the one set by `jax.set_mesh`. Auto and Explicit
        axes both work.
    - `axis`: the mesh axis the experts are laid out over (default `"expert"`).
    - `data_axes`: the other mesh axes the tokens are split over: a name, a tuple, or
        `None` (default) for every other axis of the mesh not already manual (inside a
        pipeline's stage, every axis but the stage axis); inside a `shard_map` Manual over
        `axis`, the axes of that `shard_map` that split the tokens (`None`: all of them),
        which `dropped` sums over. Axes left out (a `"model"`
        axis inside each expert) stay with the compiler, which lays out the experts'
        other dims as their shardings say.
    - `capacity_factor`: `None` (default) for dropless, or a number `c > 0` for GShard's
        capacity `ceil(c * n_local * k / E)` per expert and device.
    - `return_dropped`: also return how many assignments were dropped (an int32 scalar;
        always 0 when dropless).

    **Returns:**

    `y` of shape `(N, D_out)`, split over the token axes; with `return_dropped`, the
    pair `(y, dropped)`.

    **Raises:**

    - `ValueError`: if no `mesh` is given or set; if the mesh lacks `axis` or one of
        `data_axes` (or, inside a `shard_map` Manual over `axis`, one of `data_axes` is
        not Manual there); if the leaves of `experts` disagree on `E` (each listed), or `E` is
        not divisible by the size of `axis`; if `x` is not `(N, D)`, `indices` or
        `weights` not `(N, k)`, or `N` not divisible by the number of devices the tokens
        are split over; if `capacity_factor` is not a number > 0.
    - `TypeError`: if `indices` are not integers, `axis` not a string or `mesh` not a mesh.

    !!! Example

        ```python
        auto = (jax.sharding.AxisType.Auto,) * 2
        mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=auto)
        keys = jax.random.split(jax.random.key(0), 8)
        experts = eqx.filter_vmap(lambda k: eqx.nn.MLP(16, 16, 32, 1, key=k))(keys)
        x = jax.random.normal(jax.random.key(1), (64, 16))
        router = jax.random.normal(jax.random.key(2), (16, 8))
        weights, indices = jax.lax.top_k(jax.nn.softmax(x @ router), 2)
        experts = eqxshard.filter_shard(experts, mesh, P("expert"))
        y = eqxshard.moe(
            lambda block, h: jax.vmap(block)(h), experts, x, indices, weights, mesh=mesh
        )
        ```
    """
    p = check(
        "moe",
        experts,
        x,
        indices,
        weights,
        mesh=mesh,
        axis=axis,
        data_axes=data_axes,
        capacity_factor=capacity_factor,
    )
    if p.axis in _compat.manual_axes_here():  # each device's experts and tokens, as held
        y, dropped = dispatch(expert, experts, x, indices, weights, p)
        return (y, dropped) if return_dropped else y
    params, static = eqx.partition(experts, eqx.is_array)
    y, dropped = _program(expert, static, p)(params, x, indices, weights)
    return (y, dropped) if return_dropped else y
