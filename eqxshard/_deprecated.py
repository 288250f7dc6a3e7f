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

# Old top-level name -> (its new name, as users write it; the object; why it moved).
_REPORT = "the records of reports moved to `eqxshard.report`"
_RULES = "what a rule of your own needs moved to `eqxshard.rules`"
_LINKS = "the links `auto_plan` times moved to `eqxshard.links`"
MOVED: dict[str, tuple[str, Any, str]] = {
    "filter_plan": (
        "eqxshard.filter_shardings",
        filter_shardings,
        "renamed for what it returns: shardings, not a `Plan`",
    ),
    "Candidate": ("eqxshard.report.Candidate", Candidate, _REPORT),
    "LeafRow": ("eqxshard.report.LeafRow", LeafRow, _REPORT),
    "ShardingTable": ("eqxshard.report.ShardingTable", ShardingTable, _REPORT),
    "StageRow": ("eqxshard.report.StageRow", StageRow, _REPORT),
    "StepLeaf": ("eqxshard.report.StepLeaf", StepLeaf, _REPORT),
    "StepReport": ("eqxshard.report.StepReport", StepReport, _REPORT),
    "SetupReport": ("eqxshard.report.SetupReport", SetupReport, _REPORT),
    "Link": ("eqxshard.links.Link", Link, _LINKS),
    "LINKS": ("eqxshard.links.LINKS", LINKS, _LINKS),
    "Rule": ("eqxshard.rules.Rule", Rule, _RULES),
    "NO_MATCH": ("eqxshard.rules.NO_MATCH", NO_MATCH, _RULES),
    "dotted_path": ("eqxshard.rules.dotted_path", dotted_path, _RULES),
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
