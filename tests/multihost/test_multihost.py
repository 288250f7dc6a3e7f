"""Real multi-host runs: 2 processes x 4 CPU devices on 127.0.0.1 (gloo collectives).

Each group of scenarios in `worker.py` is one pair of processes; each scenario is one
test here, which passes when both processes report it passed. A group runs once per
pytest session, also under pytest-xdist: the first test of a group to need it runs the
pair (holding a lock file), writes every report to a JSON file, and the tests of that
group read it from there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import HERE, check_clean_exit, check_scenario, load_worker, run_once, run_workers
from worker_common import NUM_PROCESSES

WORKER = HERE / "worker.py"
SCENARIOS: dict[str, dict[str, Any]] = load_worker(WORKER, "eqxshard_multihost_worker").SCENARIOS


def group_results(group: str, multihost_dir: Path) -> dict[str, Any]:
    return run_once(
        multihost_dir,
        group,
        lambda: run_workers(WORKER, NUM_PROCESSES, multihost_dir, f"{group}-", group),
    )


CASES = [(group, name) for group, names in SCENARIOS.items() for name in names]


@pytest.mark.parametrize(("group", "name"), CASES, ids=[f"{g}-{n}" for g, n in CASES])
def test_scenario_passes_on_every_process(group: str, name: str, multihost_dir: Path) -> None:
    check_scenario(group_results(group, multihost_dir), name, NUM_PROCESSES)


def test_every_group_exits_cleanly(multihost_dir: Path) -> None:
    for group in SCENARIOS:
        run = group_results(group, multihost_dir)
        check_clean_exit(run, NUM_PROCESSES, f"{group}: ")
        assert set(run["reports"]) == set(SCENARIOS[group]), f"{group}: {run['reports'].keys()}"
