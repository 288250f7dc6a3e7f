"""Processes that pass different trees raise on every process, naming what each passed.

Before, such calls aborted the run in a collective whose size differed between processes
("terminate called after throwing gloo::EnforceNotMet ... collective mismatch"). Both
processes of `mismatch_worker.py` run every scenario once (see `harness.run_once`); each
scenario is one test here, which passes when both processes report it passed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import HERE, check_clean_exit, check_scenario, load_worker, run_once, run_workers

WORKER = HERE / "mismatch_worker.py"
NUM_PROCESSES = 2
SCENARIOS = list(load_worker(WORKER, "eqxshard_mismatch_worker").SCENARIOS)


@pytest.fixture(scope="session")
def run(multihost_dir: Path) -> dict[str, Any]:
    return run_once(
        multihost_dir,
        "mismatch",
        lambda: run_workers(WORKER, NUM_PROCESSES, multihost_dir, "mismatch-"),
    )


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_passes_on_every_process(name: str, run: dict[str, Any]) -> None:
    check_scenario(run, name, NUM_PROCESSES)


def test_processes_exit_cleanly(run: dict[str, Any]) -> None:
    check_clean_exit(run, NUM_PROCESSES)
