"""`moe`'s arguments checked in Python before anything runs, read into one record: the
mesh, the expert axis and the axes the tokens are split over, and the sizes the dispatch
is built from."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh

from .. import _compat
from .._tree import leading_dim, leaf_error, shape_str


@dataclass(frozen=True)
class Problem:
    """What one `moe` call dispatches: `n_experts` experts over `axis` (`per_device` on
    each device), `tokens` tokens of `k` choices each split over `token_axes` (`local` on
    each device), and the capacity (`None`: dropless)."""

    mesh: Mesh | AbstractMesh
    axis: str
    token_axes: tuple[str, ...]
    n_experts: int
    per_device: int
    tokens: int
    local: int
    k: int
    capacity_factor: float | None

    @property
    def capacity(self) -> int | None:
        """GShard's per-device capacity of one expert, `ceil(c * local * k / E)`."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * self.local * self.k / self.n_experts)


def expert_count(experts: Any, verb: str) -> int:
    """The leading (expert) dim every array leaf of `experts` shares, or a `ValueError`
    listing the leaves that disagree."""
    n, bad = leading_dim(experts)
    if n is None and not bad:
        raise ValueError(
            f"`{verb}` got `experts` with no array leaves; expected the experts stacked along "
            "a leading expert dim: `eqx.filter_vmap(make_expert)(jax.random.split(key, E))`."
        )
    if n is None or bad:
        raise ValueError(
            leaf_error(
                f"`{verb}` needs every array leaf of `experts` to have the same leading "
                f"(expert) dim; most have {n}, these do not:",
                bad,
                "Stack the experts with `eqx.filter_vmap(make_expert)(keys)`, and keep arrays "
                "that every expert shares outside `experts` (or as non-array leaves).",
            )
        )
    return n


def check_capacity_factor(capacity_factor: Any, verb: str) -> None:
    """A `ValueError` unless `capacity_factor` is `None` (dropless) or a number > 0."""
    if capacity_factor is not None and (
        isinstance(capacity_factor, bool)
        or not isinstance(capacity_factor, (int, float))
        or not capacity_factor > 0
    ):
        raise ValueError(
            f"`{verb}` takes `capacity_factor` as a number > 0, or `None` (dropless), but got "
            f"{capacity_factor!r}."
        )


def _mesh(mesh: Any, verb: str) -> Mesh | AbstractMesh:
    if mesh is None:
        mesh = _compat.ambient_mesh()
        if mesh is None:
            raise ValueError(
                f"`{verb}` got no `mesh` and no mesh is set. Pass `mesh=` (a mesh with an "
                "expert axis), or call it under `jax.set_mesh(mesh)`."
            )
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(f"`{verb}` takes `mesh` as a `jax.sharding.Mesh`, but got {mesh!r}.")
    return _compat.nested_mesh(mesh)  # inside a pipeline's stage: the mesh JAX has there


def _token_axes(
    data_axes: Any, mesh: Mesh | AbstractMesh, axis: str, verb: str, local: bool
) -> tuple[str, ...]:
    names = tuple(mesh.axis_names)
    types = _compat.axis_type_map(mesh)
    if data_axes is None and local:  # the axes of the `shard_map` the call is inside
        return tuple(a for a in names if a == axis or types[a] == AxisType.Manual)
    if data_axes is None:  # every axis not already manual (an outer `shard_map`'s, a stage's)
        return tuple(a for a in names if a == axis or types[a] != AxisType.Manual)
    given = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    missing = [a for a in given if a not in names or a == axis]
    if missing or not all(isinstance(a, str) for a in given):
        raise ValueError(
            f"`{verb}` got `data_axes={data_axes!r}`, but {missing} are not axes of the mesh "
            f"{names} other than the expert axis {axis!r}. Name the mesh axes the tokens are "
            "split over besides the expert axis, or `None` for every other axis."
        )
    if local and any(types[a] != AxisType.Manual for a in given):
        raise ValueError(
            f"`{verb}` was called inside a `shard_map` over the expert axis {axis!r}, with "
            f"`data_axes={data_axes!r}`, but that `shard_map` leaves "
            f"{[a for a in given if types[a] != AxisType.Manual]} to the compiler. Name "
            "only axes it maps (those that split the tokens each device holds), or `None`."
        )
    return tuple(a for a in names if a in given or a == axis)


def check(
    verb: str,
    experts: Any,
    x: Any,
    indices: Any,
    weights: Any,
    *,
    mesh: Any,
    axis: Any,
    data_axes: Any,
    capacity_factor: Any,
) -> Problem:
    """Every argument of `moe` checked; raises `ValueError`/`TypeError` naming the argument
    and the fix."""
    mesh = _mesh(mesh, verb)
    if not isinstance(axis, str):
        raise TypeError(f"`{verb}` takes `axis` as a mesh axis name, but got {axis!r}.")
    sizes = dict(mesh.shape)
    if axis not in sizes:
        raise ValueError(
            f"`{verb}` got `axis={axis!r}`, which the mesh lacks (its axes: "
            f"{list(sizes)}). Pass `axis=` the mesh's expert axis, or add one to the mesh: "
            f'`jax.make_mesh((..., {axis!r} size), (..., "{axis}"))`.'
        )
    # Inside a `shard_map` already Manual over `axis`, each device holds its experts and
    # its tokens: the counts below are the whole ones.
    local = axis in _compat.manual_axes_here()
    n_experts = expert_count(experts, verb) * (sizes[axis] if local else 1)
    if n_experts % sizes[axis]:
        raise ValueError(
            f"`{verb}` cannot lay out {n_experts} experts (the leading dim of `experts`) "
            f"over mesh axis {axis!r} of size {sizes[axis]}: {n_experts} is not divisible by "
            f"{sizes[axis]}. Use a multiple of {sizes[axis]} experts, or a mesh whose "
            f"{axis!r} axis size divides {n_experts}."
        )
    check_capacity_factor(capacity_factor, verb)
    shape_x = tuple(getattr(x, "shape", ()))
    if not hasattr(x, "dtype") or len(shape_x) != 2:
        raise ValueError(
            f"`{verb}` takes `x` as tokens of shape (N, D), but got "
            f"{'shape ' + shape_str(shape_x) if hasattr(x, 'dtype') else type(x).__name__}. "
            "Flatten the batch and sequence dims first: `x.reshape(-1, x.shape[-1])`."
        )
    n = shape_x[0]
    for name, a in (("indices", indices), ("weights", weights)):
        shape = tuple(getattr(a, "shape", ()))
        if not hasattr(a, "dtype") or len(shape) != 2 or shape[0] != n:
            got = "shape " + shape_str(shape) if hasattr(a, "dtype") else type(a).__name__
            raise ValueError(
                f"`{verb}` takes `{name}` of shape (N, k) = ({n}, k) for `x` of shape "
                f"{shape_str(shape_x)}, but got {got}. Give each token its k experts "
                "(`indices`) and their combine weights (`weights`), e.g. from "
                "`jax.lax.top_k(router_logits, k)`."
            )
    if indices.shape != weights.shape:
        raise ValueError(
            f"`{verb}` takes `indices` and `weights` of one shape (N, k), but got "
            f"{shape_str(indices.shape)} and {shape_str(weights.shape)}."
        )
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(
            f"`{verb}` takes `indices` as integers (expert numbers), but got dtype "
            f"{indices.dtype}. Pass `jax.lax.top_k(logits, k)[1]`, or cast with "
            "`indices.astype(jnp.int32)`."
        )
    token_axes = _token_axes(data_axes, mesh, axis, verb, local)
    devices = math.prod(sizes[a] for a in token_axes)
    n = n * devices if local else n
    if n % devices:
        raise ValueError(
            f"`{verb}` splits the {n} tokens of `x` over mesh axes {token_axes} "
            f"({devices} devices), but {n} is not divisible by {devices}. Pad the tokens to "
            f"a multiple of {devices}, or narrow `data_axes`."
        )
    return Problem(
        mesh=mesh,
        axis=axis,
        token_axes=token_axes,
        n_experts=n_experts,
        per_device=n_experts // sizes[axis],
        tokens=n,
        local=n // devices,
        k=indices.shape[1],
        capacity_factor=None if capacity_factor is None else float(capacity_factor),
    )
