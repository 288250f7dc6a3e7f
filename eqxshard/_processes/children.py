"""The launcher's children: their environment and command, their output forwarded with
a `[k] ` prefix, and ending them all (a signal, a grace period, then a kill).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from .gloo_chatter import GlooChatter
from .initialize import COORDINATOR_VAR, NUM_PROCESSES_VAR, PROCESS_ID_VAR

# How often the launcher looks at its processes, and how long a SIGTERM has before SIGKILL.
# JAX catches SIGTERM (it takes it as a preemption notice and carries on), so for a JAX
# process the grace period is only a delay: kept short, a survivor ends about 1 s after a
# process failed.
_POLL_S = 0.05
GRACE_S = 1.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one is listening on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(
    base: Mapping[str, str],
    *,
    process_id: int,
    num_processes: int,
    port: int,
    devices_per_process: int | None = None,
) -> dict[str, str]:
    """The environment of process `process_id` of a local run.

    `base` with the variables `eqxshard.initialize()` reads, gloo for CPU collectives,
    `devices_per_process` CPU devices (JAX on the CPU only) when given, and unbuffered
    Python output (so that lines arrive as they are printed).
    """
    env = dict(base)
    env[COORDINATOR_VAR] = f"127.0.0.1:{port}"
    env[NUM_PROCESSES_VAR] = str(num_processes)
    env[PROCESS_ID_VAR] = str(process_id)
    env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    if devices_per_process is not None:
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
    env["PYTHONUNBUFFERED"] = "1"
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


def _forward(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    chatter = GlooChatter()  # one per process: its messages can be split over two lines
    for line in iter(stream.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            for kept in chatter.filter(line):
                out.write(prefix + kept)
            out.flush()
    stream.close()


class _Stopped(Exception):
    """The launcher itself was asked to stop (SIGTERM, SIGHUP)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped(signum)


def _exit_code(returncode: int) -> int:
    """A child's return code as a process exit code (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_all(procs: Sequence[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:  # each child leads its own process group: it and what it started
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def _end_all(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every process still running, SIGKILL to those alive after `grace` s."""
    _signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    _signal_all(procs, signal.SIGKILL)
    for p in procs:
        p.wait()
