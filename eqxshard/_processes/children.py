"""The launcher's children: their environment and command, their output forwarded with
a `[k] ` prefix, and ending them all (a signal, a grace period, then a kill).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .clusters import (
    COORDINATOR_VAR,
    HEARTBEAT_TIMEOUT_VAR,
    HOSTS_VAR,
    INITIALIZATION_TIMEOUT_VAR,
    NUM_PROCESSES_VAR,
    PROCESS_ID_VAR,
    PROCESSES_PER_HOST_VAR,
    RESTART_VAR,
)

# How often the launcher looks at its processes, and how long a SIGTERM has before SIGKILL.
# JAX catches SIGTERM (it takes it as a preemption notice and carries on), so for a JAX
# process the grace period is only a delay: kept short, a survivor ends about 1 s after a
# process failed.
POLL_S = 0.05
GRACE_S = 1.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one is listening on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variables(
    *,
    process_id: int,
    num_processes: int,
    coordinator: str,
    devices_per_process: int | None = None,
    hosts: Sequence[str] | None = None,
    processes_per_host: int | None = None,
    heartbeat_timeout: int | None = None,
    initialization_timeout: int | None = None,
    restart: int = 0,
) -> dict[str, str]:
    """The variables the launcher sets for process `process_id`: those
    `eqxshard.initialize()` reads (the coordinator `HOST:PORT`, the process count, its
    id, the bounds, the run's hosts), gloo for CPU collectives, `devices_per_process` CPU
    devices (JAX on the CPU only) when given, and unbuffered Python output (so that lines
    arrive as they are printed)."""
    env = {
        PROCESS_ID_VAR: str(process_id),
        NUM_PROCESSES_VAR: str(num_processes),
        COORDINATOR_VAR: coordinator,
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
    }
    if devices_per_process is not None:
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
    if hosts is not None:
        env[HOSTS_VAR] = ",".join(hosts)
        env[PROCESSES_PER_HOST_VAR] = str(processes_per_host or 1)
    if heartbeat_timeout is not None:
        env[HEARTBEAT_TIMEOUT_VAR] = str(heartbeat_timeout)
    if initialization_timeout is not None:
        env[INITIALIZATION_TIMEOUT_VAR] = str(initialization_timeout)
    env[RESTART_VAR] = str(restart)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def process_env(
    base: Mapping[str, str],
    *,
    process_id: int,
    num_processes: int,
    port: int,
    devices_per_process: int | None = None,
    **variables: Any,
) -> dict[str, str]:
    """The environment of process `process_id` of a run on this machine: `base` with
    `run_variables(...)` (see there; `variables` are its other arguments), the
    coordinator on `127.0.0.1:port`."""
    env = dict(base)
    env.update(
        run_variables(
            process_id=process_id,
            num_processes=num_processes,
            coordinator=f"127.0.0.1:{port}",
            devices_per_process=devices_per_process,
            **variables,
        )
    )
    return env


# Python 3.11 has no `sys.monitoring`: there a script runs through this runner, which sees
# a `SystemExit` leave it (see run_main.py).
RUN_MAIN = str(Path(__file__).with_name("run_main.py"))


def child_command(command: Sequence[str]) -> list[str]:
    """`script.py args` and `-m module args` run with this Python (on Python 3.11 through
    `run_main.py`); anything else as given."""
    command = list(command)
    if command and (command[0].endswith(".py") or command[0] == "-m"):
        runner = [RUN_MAIN] if sys.version_info < (3, 12) else []
        return [sys.executable, *runner, *command]
    return command


class Stopped(Exception):
    """The launcher itself was asked to stop (SIGTERM, SIGHUP)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(returncode: int) -> int:
    """A child's return code as a process exit code (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_all(procs: Sequence[subprocess.Popen], sig: int) -> None:
    """`sig` to the process group of each child: it and what it started. Also where the
    child itself has ended: a wrapper such as `timeout` or `ssh` ends on SIGTERM and
    leaves the JAX process it started running (JAX takes SIGTERM as a preemption notice).
    The kernel keeps a group's id from being reused while any member lives."""
    for p in procs:
        try:  # each child leads its own process group
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def end_all(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every process still running, SIGKILL to those alive after `grace` s."""
    _signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(_group_alive(p.pid) for p in procs) and time.monotonic() < deadline:
        time.sleep(POLL_S)
        for p in procs:
            p.poll()  # reap the child itself (the group's other members are not ours to reap)
    _signal_all(procs, signal.SIGKILL)
    for p in procs:
        p.wait()
