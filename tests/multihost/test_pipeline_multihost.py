"""`filter_pipeline` on a real multi-host run, the stage axis across processes: 2 processes
x 4 CPU devices give the one-process result (values and gradients).

`pipeline_worker.py` holds the scenarios; both processes run them all once (see
`harness.run_once`), and each scenario is one test here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import HERE, check_clean_exit, check_listed, check_scenario, run_scenarios

pytestmark = pytest.mark.heavy

WORKER = HERE / "pipeline_worker.py"
NUM_PROCESSES = 2
SCENARIOS = [
    "stages_across_processes_equal_one_process",
    "data_and_stages_across_processes_equal_one_process",
]


@pytest.fixture(scope="session")
def run(multihost_dir: Path) -> dict[str, Any]:
    return run_scenarios(multihost_dir, "pipeline", WORKER, NUM_PROCESSES)


def test_worker_runs_the_listed_scenarios() -> None:
    check_listed(WORKER, SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_passes_on_every_process(name: str, run: dict[str, Any]) -> None:
    check_scenario(run, name, NUM_PROCESSES)


def test_processes_exit_cleanly(run: dict[str, Any]) -> None:
    check_clean_exit(run, NUM_PROCESSES)
