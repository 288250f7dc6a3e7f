"""`Experts`: the Equinox module holding a mixture-of-experts layer's experts, run by
`moe`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, Mesh

from .checks import check_capacity_factor, expert_count
from .moe import moe
from .unsplit import unsplit

FIELD = "expert_blocks"
"""The field of `Experts` that holds the stacked experts: the `experts` rule splits the
leaves under it (their dotted path has this part)."""


def per_token(block: Any, h: jax.Array) -> jax.Array:
    """The default `expert`: `block` (an Equinox module applying to one token) on every
    row of `h`."""
    return jax.vmap(block)(h)


class Experts(eqx.Module):
    """A mixture-of-experts layer's experts, laid out over a mesh axis (expert parallelism).

    Holds `E` experts stacked along a leading expert dim, as `Stacked` holds layers
    (`eqx.filter_vmap(make_expert)(keys)`), and runs them with `moe`: calling it on
    tokens `x` `(N, D)` and the router's choices gives
    `y[n] = sum_j weights[n, j] * expert(blocks[indices[n, j]], x[n])`, each expert
    computed on the devices that hold it. The router stays in the model, so any routing
    (top-k, softmax before or after, auxiliary losses) is the model's own.

    Lay it out with the `experts` rule (`filter_shard(model, mesh, experts("expert") |
    fsdp("data"))`, or in `filter_init`, `filter_jit`'s specs, `describe`); it works inside
    `Stacked` (a scan over MoE layers) and `filter_jit`, and eagerly.

    **Arguments:**

    - `blocks`: a PyTree whose array leaves share a leading expert dim `E`; stored as the
        field `expert_blocks` (the name the `experts` rule and checkpoints see).
    - `expert`: `expert(block, h) -> out`, one expert on a batch of tokens `h` `(m, D)`;
        `None` (default) for blocks that are Equinox modules applying to one token,
        `jax.vmap(block)(h)`. Pass a module-level function (not a new lambda per call),
        so that `moe`'s compiled programs are reused.
    - `axis`: the mesh axis the experts are laid out over (default `"expert"`), or `None`:
        laid out over no axis, every expert run on every token where the tokens are
        (`E` times one expert's work, and no mesh needed; with a `capacity_factor`, the
        `N` tokens of a call are one group). `auto_plan` weighs this for the layouts
        without an expert axis, and a `Plan` without `experts` sets it.
    - `data_axes`: the other mesh axes the tokens are split over; `None` (default) for
        every other axis (see `moe`).
    - `capacity_factor`: `None` (default, dropless) or GShard's capacity factor (see
        `moe`).
    - `mesh`: the mesh; `None` (default) uses the one set by `jax.set_mesh` when called.

    **Raises:**

    - `ValueError`: if the array leaves of `blocks` disagree on `E` (each listed), or
        `capacity_factor` is not a number > 0.
    - `TypeError`: if `axis` is not a string or `None`, or `expert` not callable.

    Calling it raises what `moe` raises.

    !!! Example

        ```python
        keys = jax.random.split(jax.random.key(0), 8)
        blocks = eqx.filter_vmap(lambda k: eqx.nn.MLP(16, 16, 32, 1, key=k))(keys)  # 8 experts
        auto = (jax.sharding.AxisType.Auto,) * 2
        mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=auto)
        layer = eqxshard.Experts(blocks, mesh=mesh)
        layer = eqxshard.filter_shard(layer, mesh, eqxshard.experts("expert"))
        x = jax.random.normal(jax.random.key(1), (64, 16))
        router = jax.random.normal(jax.random.key(2), (16, 8))
        weights, indices = jax.lax.top_k(jax.nn.softmax(x @ router), 2)
        y = layer(x, indices, weights)
        capped = eqxshard.Experts(layer.expert_blocks, capacity_factor=1.0, mesh=mesh)
        y, dropped = capped(x, indices, weights, return_dropped=True)
        ```
    """

    expert_blocks: Any
    expert: Callable[[Any, jax.Array], jax.Array] | None = eqx.field(static=True)
    axis: str | None = eqx.field(static=True)
    data_axes: str | tuple[str, ...] | None = eqx.field(static=True)
    capacity_factor: float | None = eqx.field(static=True)
    mesh: Mesh | AbstractMesh | None = eqx.field(static=True)

    def __init__(
        self,
        blocks: Any,
        expert: Callable[[Any, jax.Array], jax.Array] | None = None,
        *,
        axis: str | None = "expert",
        data_axes: str | tuple[str, ...] | None = None,
        capacity_factor: float | None = None,
        mesh: Mesh | AbstractMesh | None = None,
    ):
        expert_count(blocks, "Experts")
        if axis is not None and not isinstance(axis, str):
            raise TypeError(
                f"`Experts` takes `axis` as a mesh axis name, or None, but got {axis!r}."
            )
        if expert is not None and not callable(expert):
            raise TypeError(
                f"`Experts` takes `expert` as a function `expert(block, h)`, or None, but got "
                f"{expert!r}."
            )
        check_capacity_factor(capacity_factor, "Experts")
        self.expert_blocks = blocks
        self.expert, self.axis, self.data_axes = expert, axis, data_axes
        self.capacity_factor, self.mesh = capacity_factor, mesh

    @property
    def n(self) -> int:
        """The number of experts `E`: the leading dim of every array leaf."""
        return expert_count(self.expert_blocks, "Experts")

    def __call__(
        self,
        x: jax.Array,
        indices: jax.Array,
        weights: jax.Array,
        *,
        return_dropped: bool = False,
    ) -> Any:
        """`moe` on these experts: tokens `x` `(N, D)`, each token's experts `indices`
        `(N, k)` and combine `weights` `(N, k)`. Returns `y` `(N, D_out)`, or
        `(y, dropped)` with `return_dropped`."""
        expert = self.expert if self.expert is not None else per_token
        if self.axis is None:
            y, dropped = unsplit(
                expert, self.expert_blocks, x, indices, weights, self.capacity_factor
            )
            return (y, dropped) if return_dropped else y
        return moe(
            expert,
            self.expert_blocks,
            x,
            indices,
            weights,
            mesh=self.mesh,
            axis=self.axis,
            data_axes=self.data_axes,
            capacity_factor=self.capacity_factor,
            return_dropped=return_dropped,
        )


def configured(tree: Any, *, axis: str | None, mesh: Mesh | AbstractMesh | None) -> Any:
    """`tree` (a model, or an optimiser state shaped like one) with every `Experts` in it
    set to lay out its experts over `axis` of `mesh` (`axis=None`: over none); `tree`
    itself when it holds no `Experts`. Its array leaves are the same objects."""
    is_experts = lambda x: isinstance(x, Experts)
    if not any(is_experts(x) for x in jax.tree.leaves(tree, is_leaf=is_experts)):
        return tree

    def rebuilt(x: Any) -> Any:
        if not is_experts(x):
            return x
        new = object.__new__(type(x))
        for f in dataclasses.fields(x):
            value = {"axis": axis, "mesh": mesh}.get(f.name, getattr(x, f.name))
            object.__setattr__(new, f.name, value)
        return new

    return jax.tree.map(rebuilt, tree, is_leaf=is_experts)
