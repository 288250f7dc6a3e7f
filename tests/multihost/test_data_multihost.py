"""Data from every host, never gathered (issue 20): 2 processes x 4 CPU devices, each
reading only its own file of rows (`data_worker.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import HERE, check_clean_exit, check_scenario, load_worker, run_once, run_workers
from worker_common import NUM_PROCESSES

WORKER = HERE / "data_worker.py"
SCENARIOS = list(load_worker(WORKER, "eqxshard_data_worker").SCENARIOS)

pytestmark = pytest.mark.heavy


def _write_and_run(workdir: Path) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    for p in range(NUM_PROCESSES):
        np.save(workdir / f"rows-{p}.npy", rng.normal(size=(16, 8)).astype(np.float32))
    return run_workers(WORKER, NUM_PROCESSES, workdir, "data-", str(workdir))


@pytest.fixture(scope="session")
def run(multihost_dir: Path) -> dict[str, Any]:
    workdir = multihost_dir / "data"
    workdir.mkdir(exist_ok=True)
    return run_once(workdir, "run", lambda: _write_and_run(workdir))


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_passes_on_every_process(name: str, run: dict[str, Any]) -> None:
    check_scenario(run, name, NUM_PROCESSES)


def test_processes_exit_cleanly(run: dict[str, Any]) -> None:
    check_clean_exit(run, NUM_PROCESSES)
