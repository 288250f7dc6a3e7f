"""The records eqxshard's reports are made of: read them, never build them.

- `Candidate`: one row of `auto_plan`'s table (`plan.table`).
- `LeafRow`, `ShardingTable`: `describe`'s table and its rows.
- `StageRow`: a row of `ShardingTable.by_stage()`.
- `StepLeaf`, `StepReport`: `describe_step`'s report and its rows.
- `SetupReport`: what `check_setup` found.
"""

from ._plans.auto.candidate import Candidate as Candidate
from ._plans.by_stage import StageRow as StageRow
from ._plans.table import LeafRow as LeafRow, ShardingTable as ShardingTable
from ._processes.setup_check import SetupReport as SetupReport
from ._step.describe_step import StepLeaf as StepLeaf, StepReport as StepReport
