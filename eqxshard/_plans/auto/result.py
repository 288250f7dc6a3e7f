"""What `auto_plan` returns: a `Plan` (plain data that acts) and its ranked `Candidate`s."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from ..._placement.shard import filter_shard
from ..._tree import format_bytes
from ..plan import filter_init
from . import view


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout `auto_plan` tried: a row of `Plan.table`.

    - `rank`: its place in the table (1 is the chosen plan); fitting candidates come first,
        fastest first, then those that do not fit, smallest first.
    - `name`: the rule family: `DP` (parameters replicated), `FSDP`, `TP` (tensor
        parallel), products of these (`FSDP x TP`), or `rules[k]` for the user's `k`th rule.
    - `mesh_shape`: axis name -> size (size-1 axes dropped).
    - `rules`: the rule, usable as any `spec` (its `repr` is Python to paste and edit).
    - `bytes`: bytes per device by part: `parameters`, `gradients` (with an optimiser),
        `optimizer state`, `batch`, `activations` (with every other temporary).
    - `total_bytes`: bytes per device of the whole compiled step (arguments, outputs
        less what they reuse by donation, temporaries); `None` if it could not be built.
    - `collectives`: bytes each device sends per step, by kind (`all-reduce`,
        `all-gather`, `reduce-scatter`, `all-to-all`, `collective-permute`).
    - `communication_time`, `compute_time`, `time`: estimated seconds per step (the
        alpha-beta model over the axes' links; flops over `flops_per_second`; their sum).
    - `fits`: whether `total_bytes` is within the budget.
    - `estimated`: whether the figures come from a smaller mesh (see `measured_on`).
    - `measured_on`: where the figures come from: `compiled here`, `compiled in a
        subprocess with N CPU devices`, or the smaller mesh they are scaled from.
    - `reason`: why it was chosen or not (over budget by how much, how much slower).
    """

    rank: int
    name: str
    mesh_shape: dict[str, int]
    rules: Any
    bytes: dict[str, int]
    total_bytes: int | None
    collectives: dict[str, int]
    communication_time: float | None
    compute_time: float | None
    time: float | None
    fits: bool
    estimated: bool
    measured_on: str
    reason: str


@dataclasses.dataclass(frozen=True, repr=False)
class Plan:
    """The layout `auto_plan` chose, and every candidate it weighed.

    - `mesh`: a `Mesh` over the devices asked for, or an `AbstractMesh` of the same
        shape when there are more devices than this machine has.
    - `rules`: the rule for the model and the optimiser state, usable as `spec`
        anywhere (`filter_shard`, `filter_plan`, `filter_init`, `describe`). Its `repr`
        is Python to paste into a script and edit.
    - `batch_spec`: the `PartitionSpec` of every batch leaf (its leading dim split over
        the data axes).
    - `table`: every `Candidate`, ranked; `table[0]` is the chosen one.
    - `budget`: the budget in bytes per device.

    `print(plan)` shows the table; a notebook shows it as HTML, with a chart of each
    candidate's bytes per device against the budget.
    """

    mesh: Mesh | AbstractMesh
    rules: Any
    batch_spec: PartitionSpec
    table: list[Candidate]
    budget: int

    @property
    def chosen(self) -> Candidate:
        return self.table[0]

    def _concrete_mesh(self, verb: str) -> Mesh:
        if isinstance(self.mesh, Mesh):
            return self.mesh
        shape = dict(self.mesh.shape)
        raise ValueError(
            f"`Plan.{verb}` needs the devices, but this plan is for {self.mesh.size} devices "
            f"and this process has {jax.device_count()}. On the cluster, build the mesh "
            f"`jax.make_mesh({tuple(shape.values())}, {tuple(shape)}, "
            f"axis_types=(AxisType.Auto,) * {len(shape)})` (Auto axes, as planned) and pass it "
            "with `plan.rules` to `filter_shard` / `filter_init` (and `plan.batch_spec` for the "
            "batch)."
        )

    def shard(self, model: Any, opt_state: Any = None, batch: Any = None) -> tuple[Any, Any, Any]:
        """`(model, opt_state, batch)` placed by the plan with `filter_shard` (`None`s are
        returned as they are). Raises `ValueError` for a plan over an `AbstractMesh`."""
        mesh = self._concrete_mesh("shard")
        place = lambda tree, spec: None if tree is None else filter_shard(tree, mesh, spec)
        return place(model, self.rules), place(opt_state, self.rules), place(batch, self.batch_spec)

    def init(self, make_model: Callable[..., Any], optimizer: Any = None) -> Callable[..., Any]:
        """A function of `make_model`'s arguments (usually a key) returning the model, born
        sharded by `filter_init`, and with `optimizer` also its state, as
        `(model, opt_state)`. Raises `ValueError` for a plan over an `AbstractMesh`."""
        mesh = self._concrete_mesh("init")

        def init(*args: Any, **kwargs: Any) -> Any:
            model = filter_init(make_model, mesh, self.rules)(*args, **kwargs)
            if optimizer is None:
                return model
            opt_init = lambda m: optimizer.init(eqx.filter(m, eqx.is_array))
            return model, filter_init(opt_init, mesh, self.rules)(model)

        return init

    def summary(self) -> str:
        c = self.chosen
        return (
            f"Chosen: {c.name} on {view.mesh_str(c.mesh_shape)}: "
            f"{format_bytes(c.total_bytes or 0)} per device of {format_bytes(self.budget)}, "
            f"estimated {view.seconds_str(c.time)} per step. {c.reason}"
        )

    def __str__(self) -> str:
        return view.text(self)

    def __repr__(self) -> str:
        return (
            f"Plan(mesh_shape={dict(self.mesh.shape)!r}, rules={self.rules!r}, "
            f"batch_spec={self.batch_spec!r}, candidates={len(self.table)})"
        )

    def _repr_html_(self) -> str:
        return view.to_html(self)
