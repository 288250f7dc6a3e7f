"""A row of `Plan.table`: one layout `auto_plan` weighed, with its figures and verdict."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout `auto_plan` tried: a row of `Plan.table`.

    - `rank`: its place in the table (1 is the chosen plan); fitting candidates come first,
        fastest first, then those that do not fit, smallest first.
    - `name`: the rule family: `DP` (parameters replicated), `FSDP`, `TP` (tensor
        parallel), products of these (`FSDP x TP`), or `rules[k]` for the user's `k`th rule.
    - `mesh_shape`: axis name -> size (size-1 axes dropped).
    - `rules`: the rule, usable as any `spec` (its `repr` is Python to paste and edit).
    - `bytes`: bytes per device by part: `parameters`, `gradients` (with an optimiser;
        less what the compiled step never holds at once, where XLA fused the update into
        the backward pass), `optimizer state` (0 when offloaded), `batch`, `activations`
        (with every other temporary).
    - `total_bytes`: bytes per device of the whole compiled step (arguments, outputs
        less what they reuse by donation, temporaries); `None` if it could not be built.
    - `collectives`: bytes each device sends per step, by kind (`all-reduce`,
        `all-gather`, `reduce-scatter`, `all-to-all`, `collective-permute`).
    - `communication_time`, `compute_time`, `time`: estimated seconds per step (the
        alpha-beta model over the axes' links; flops over `flops_per_second`; their sum,
        with `host_time`).
    - `fits`: whether `total_bytes` is within the budget.
    - `estimated`: whether the figures come from a smaller mesh (see `measured_on`).
    - `measured_on`: where the figures come from: `compiled here`, `compiled in a
        subprocess with N CPU devices`, or the smaller mesh they are scaled from.
    - `reason`: why it was chosen or not (over budget by how much, how much slower).
    - `offload`: the parts held in pinned host memory between steps (`("optimizer
        state",)` or `()`).
    - `host_bytes`: bytes per device in pinned host memory, not in `total_bytes` (which
        is device memory): the optimiser state when offloaded, and the activations remat
        `"offload"` saves for the backward pass. Moving them out and in over the `host`
        link takes `host_time` seconds per step (part of `time`).
    - `remat`: the rematerialisation policy of each `Stacked` layer by path (`{}`: none).
    - `pipeline`: `None`, or `{"axis": "stage", "microbatches": M, "repeats": R}`.
    - `context`: `None`, or `{"axis": "context", "strategy": "ring"}` (and `"heads_axis":
        "model"` beside a `model` axis): the sequence split over that axis, the model's
        attention converted by `context_parallel`.
    - `experts`: `None`, or `{"axis": "expert"}`: each `eqxshard.Experts` of the model
        laid out over that axis (expert parallelism); `None`: no expert axis (a model's
        `Experts` measured unsplit, every expert on every token).
    - `choice_note`, `budget_note`: before ranking, what a refined row chose (remat
        full on a stack, say) and how it stands against the budget (`"fits with 1.2 MiB
        to spare"`, `"still 3.0 KiB over"`), said before the rest of its `reason`;
        ranking joins them into `reason` (the budget's part only where the verdict does
        not say it already), and leaves both empty.
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
    offload: tuple[str, ...] = ()
    host_bytes: int = 0
    host_time: float = 0.0
    remat: dict[str, str] = dataclasses.field(default_factory=dict)
    pipeline: dict[str, Any] | None = None
    context: dict[str, str] | None = None
    experts: dict[str, str] | None = None
    choice_note: str = ""
    budget_note: str = ""

    def note(self, *, with_budget: bool = True) -> str:
        """The row's own note: `reason`, after `choice_note` and (`with_budget`)
        `budget_note` where it has them."""
        if not self.choice_note:
            return self.reason
        said = [self.budget_note] if with_budget and self.budget_note else []
        return f"{self.choice_note}: {'; '.join([*said, self.reason])}"


def not_compiled(layout: Any, reason: str, **fields: Any) -> Candidate:
    """The row of a layout (its `name`, `shape` and `rules`) that was not compiled, saying
    why (ruled out by arithmetic, or dominated); `fields` set any other column."""
    row: dict[str, Any] = dict(
        rank=0,
        name=layout.name,
        mesh_shape=dict(layout.shape),
        rules=layout.rules,
        bytes={},
        total_bytes=None,
        collectives={},
        communication_time=None,
        compute_time=None,
        time=None,
        fits=False,
        estimated=False,
        measured_on="not compiled",
        reason=reason,
    )
    return Candidate(**{**row, **fields})


class NothingFits(ValueError):
    """What `auto_plan` raises when no layout fits the budget: a `ValueError` whose text
    names the smallest footprint, what would help, the closest rows and the least budget
    that fits; and which carries the search's table.

    - `table`: every `Candidate` weighed, ranked as `Plan.table` would be (those that
        were compiled smallest first, then those that were not).
    - `smallest_budget`: the fewest bytes per device any compiled layout needs: passed as
        `budget=`, the same search (its compiles cached) chooses that layout. `None` when
        no layout could be compiled.
    """

    def __init__(self, message: str, table: list[Candidate], smallest_budget: int | None):
        super().__init__(message)
        self.table = table
        self.smallest_budget = smallest_budget
