"""Public names that moved or were renamed, kept working: `eqxshard.NAME` gives the object
at its new place and warns `DeprecationWarning` naming that place (a module `__getattr__`,
PEP 562, which `eqxshard/__init__.py` re-exports)."""

from __future__ import annotations

import warnings
from typing import Any

from ._plans.auto.candidate import Candidate
from ._plans.auto.links import LINKS, Link
from ._plans.by_stage import StageRow
from ._plans.plan import filter_shardings
from ._plans.rules import NO_MATCH, Rule
from ._plans.table import LeafRow, ShardingTable
from ._processes.setup_check import SetupReport
from ._step.describe_step import StepLeaf, StepReport
from ._tree import dotted_path


def _same_name(module: str, why: str, **objects: Any) -> dict[str, tuple[str, Any, str]]:
    """The entries of `MOVED` for names that moved to `module` and kept their name."""
    return {name: (f"{module}.{name}", value, why) for name, value in objects.items()}


# Old top-level name -> (its new name, as users write it; the object; why it moved).
MOVED: dict[str, tuple[str, Any, str]] = {
    "filter_plan": (
        "eqxshard.filter_shardings",
        filter_shardings,
        "renamed for what it returns: shardings, not a `Plan`",
    ),
    **_same_name(
        "eqxshard.report",
        "the records of reports moved to `eqxshard.report`",
        Candidate=Candidate,
        LeafRow=LeafRow,
        ShardingTable=ShardingTable,
        StageRow=StageRow,
        StepLeaf=StepLeaf,
        StepReport=StepReport,
        SetupReport=SetupReport,
    ),
    **_same_name(
        "eqxshard.links",
        "the links `auto_plan` times moved to `eqxshard.links`",
        Link=Link,
        LINKS=LINKS,
    ),
    **_same_name(
        "eqxshard.rules",
        "what a rule of your own needs moved to `eqxshard.rules`",
        Rule=Rule,
        NO_MATCH=NO_MATCH,
        dotted_path=dotted_path,
    ),
}


def __getattr__(name: str) -> Any:
    """`eqxshard.NAME` for a name in `MOVED`: its object, with a `DeprecationWarning`."""
    if name not in MOVED:
        raise AttributeError(f"module 'eqxshard' has no attribute {name!r}")
    new, value, why = MOVED[name]
    warnings.warn(
        f"`eqxshard.{name}` is deprecated: use `{new}` ({why}).",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
