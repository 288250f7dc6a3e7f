"""Plans and sharded initialisation on a real multi-host run: 2 processes x 4 CPU devices.

`plan_worker.py` holds the scenarios; both processes run them all once (one pair of
processes per pytest session, also under pytest-xdist: see `harness.run_once`), and each
scenario is one test here, which passes when both processes report it passed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import HERE, check_clean_exit, check_listed, check_scenario, run_scenarios

WORKER = HERE / "plan_worker.py"
NUM_PROCESSES = 2
SCENARIOS = [
    "init_fsdp_holds_only_local_shards",
    "init_optimizer_state_like_params",
    "plan_and_describe_count_every_device",
    "shard_with_path_rules",
]


@pytest.fixture(scope="session")
def run(multihost_dir: Path) -> dict[str, Any]:
    return run_scenarios(multihost_dir, "plan", WORKER, NUM_PROCESSES)


def test_worker_runs_the_listed_scenarios() -> None:
    check_listed(WORKER, SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_passes_on_every_process(name: str, run: dict[str, Any]) -> None:
    check_scenario(run, name, NUM_PROCESSES)


def test_processes_exit_cleanly(run: dict[str, Any]) -> None:
    check_clean_exit(run, NUM_PROCESSES)
