"""Plans and sharded initialisation on a real multi-host run: 2 processes x 4 CPU devices.

`plan_worker.py` holds the scenarios; both processes run them all once (one pair of
processes per pytest session, started by the fixture below), and each scenario is one
test here, which passes when both processes report it passed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import eqxshard

HERE = Path(__file__).resolve().parent
WORKER = HERE / "plan_worker.py"
NUM_PROCESSES = 2
SCENARIOS = [
    "init_fsdp_holds_only_local_shards",
    "init_optimizer_state_like_params",
    "plan_and_describe_count_every_device",
    "shard_with_path_rules",
]
# Startup is seconds; this only stops a run that hangs (e.g. processes out of step).
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["JAX_PLATFORMS"] = "cpu"
    root = str(Path(eqxshard.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("plan_multihost")
    port, env = _free_port(), _child_env()
    procs, logs = [], []
    try:
        for i in range(NUM_PROCESSES):
            out = open(workdir / f"{i}.out", "w+")
            err = open(workdir / f"{i}.err", "w+")
            logs.append((out, err))
            command = [sys.executable, str(WORKER), str(port), str(i), str(NUM_PROCESSES)]
            procs.append(subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=HERE))
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for p in procs:  # only the processes started here
            if p.poll() is None:
                p.kill()
                p.wait()
    reports: dict[str, dict[int, Any]] = {}
    stderr = []
    for out, err in logs:
        out.seek(0)
        err.seek(0)
        for line in out:
            if line.startswith("{"):
                report = json.loads(line)
                reports.setdefault(report["scenario"], {})[report["process"]] = report
        stderr.append(err.read()[-3000:])
        out.close()
        err.close()
    return {
        "reports": reports,
        "returncodes": [p.returncode for p in procs],
        "timed_out": timed_out,
        "stderr": stderr,
    }


def test_worker_runs_the_listed_scenarios() -> None:
    text = WORKER.read_text()
    assert all(f"def {name}(" in text for name in SCENARIOS)
    assert text.count("@scenario") == len(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_passes_on_every_process(name: str, run: dict[str, Any]) -> None:
    reports = run["reports"].get(name, {})
    problems = []
    for process in range(NUM_PROCESSES):
        report = reports.get(process)
        if report is None:
            problems.append(
                f"process {process} gave no report (timed out: {run['timed_out']}, return "
                f"codes {run['returncodes']}); its stderr ends with:\n{run['stderr'][process]}"
            )
        elif not report["ok"]:
            problems.append(f"process {process} failed:\n{report['error']}")
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


def test_processes_exit_cleanly(run: dict[str, Any]) -> None:
    assert not run["timed_out"], run["stderr"]
    assert run["returncodes"] == [0] * NUM_PROCESSES, run["stderr"]
