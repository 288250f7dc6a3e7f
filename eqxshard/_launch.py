"""`python -m eqxshard.launch`: N processes of one script on this machine, as a cluster would.

Each process gets the variables `eqxshard.initialize()` reads (see `_initialize.py`): the
coordinator on 127.0.0.1 and a free port, the process count and its own id, plus JAX's
own variables for CPU devices and gloo collectives. The launcher forwards every line the
processes print with a `[i] ` prefix, and ends the run as one: when a process exits with
an error, the others are ended too (SIGTERM, then SIGKILL after a grace period), and the
launcher exits with that process's code. Only processes the launcher started (and
whatever they started) are ever signalled.

The launcher never starts a JAX backend of its own: it runs no JAX computation.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, TypeGuard

from ._gloo_chatter import GlooChatter
from ._initialize import COORDINATOR_VAR, NUM_PROCESSES_VAR, PROCESS_ID_VAR

# How often the launcher looks at its processes, and how long a SIGTERM has before SIGKILL.
# JAX catches SIGTERM (it takes it as a preemption notice and carries on), so for a JAX
# process the grace period is only a delay: kept short, a survivor ends about 1 s after a
# process failed.
_POLL_S = 0.05
GRACE_S = 1.0
# Exit codes of the launcher itself, as `timeout` and shells use them.
TIMEOUT_EXIT = 124
INTERRUPT_EXIT = 130


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


def child_command(command: Sequence[str]) -> list[str]:
    """`script.py args` and `-m module args` run with this Python; anything else as given."""
    command = list(command)
    if command and (command[0].endswith(".py") or command[0] == "-m"):
        return [sys.executable, *command]
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


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_arguments(
    command: object,
    num_processes: object,
    devices_per_process: object,
    port: object,
    timeout: object,
    grace: object,
    env: object,
) -> None:
    """The checks of `launch`, before any process is started."""
    if isinstance(command, str | bytes) or not isinstance(command, Sequence):
        raise TypeError(
            f"`command` must be a list of strings, e.g. `['train.py', '--steps', '10']`, but "
            f"got {type(command).__name__} {command!r}."
        )
    if not command:
        raise ValueError("`command` is empty: give the script to run, e.g. `-- train.py`.")
    if not all(isinstance(part, str) for part in command):
        raise TypeError(f"`command` must be a list of strings, but got {list(command)!r}.")
    for name, value in (
        ("num_processes", num_processes),
        ("devices_per_process", devices_per_process),
    ):
        if value is None and name == "devices_per_process":
            continue
        if not _is_int(value):
            raise TypeError(f"`{name}` must be an int, but got {type(value).__name__} {value!r}.")
        if value < 1:
            raise ValueError(f"`{name}` must be at least 1, got {value}.")
    if port is not None:
        if not _is_int(port):
            raise TypeError(
                f"`port` must be an int or None, but got {type(port).__name__} {port!r}."
            )
        if not 1 <= port <= 65535:
            raise ValueError(
                f"`port` must be a TCP port in 1..65535, got {port}; `None` picks a free one."
            )
    if timeout is not None:
        if not _is_number(timeout):
            raise TypeError(
                f"`timeout` must be a number of seconds or None, but got {type(timeout).__name__}."
            )
        if not timeout > 0:
            raise ValueError(f"`timeout` must be positive, got {timeout}.")
    if not _is_number(grace):
        raise TypeError(f"`grace` must be a number of seconds, but got {type(grace).__name__}.")
    if not grace >= 0:
        raise ValueError(f"`grace` must be >= 0 seconds, got {grace}.")
    if env is not None and not isinstance(env, Mapping):
        raise TypeError(
            f"`env` must be a mapping of strings or None, but got {type(env).__name__}."
        )


def launch(
    command: Sequence[str],
    *,
    num_processes: int,
    devices_per_process: int | None = None,
    port: int | None = None,
    timeout: float | None = None,
    grace: float = GRACE_S,
    env: Mapping[str, str] | None = None,
) -> int:
    """Runs `command` as `num_processes` processes of one run on this machine.

    **Arguments:**

    - `command`: the command of every process: `["script.py", *args]` and
      `["-m", "module", *args]` run with this Python.
    - `num_processes`: how many processes.
    - `devices_per_process`: CPU devices for each process (the run then uses the CPU
      only). `None` leaves the platform and device count to JAX.
    - `port`: the coordinator's port on 127.0.0.1; `None` picks a free one.
    - `timeout`: seconds the whole run may take; `None` for no limit.
    - `grace`: seconds between SIGTERM and SIGKILL when processes are ended. JAX catches
      SIGTERM and carries on, so a JAX process is ended by the SIGKILL, `grace` s later.
    - `env`: the environment of the processes before the launcher's variables;
      `None` is this process's.

    **Returns:**

    The exit code: 0 if every process exited with 0; otherwise that of the first process
    that failed (128 + N if killed by signal N), 124 on timeout, 130 on Ctrl-C.

    **Raises:**

    - `TypeError`: if an argument has the wrong type (e.g. `command` a string).
    - `ValueError`: if `command` is empty, a count or `timeout` is not positive, `port`
      is not in 1..65535, or `grace` is negative.
    """
    _check_arguments(command, num_processes, devices_per_process, port, timeout, grace, env)
    port = free_port() if port is None else port
    base = dict(os.environ if env is None else env)
    argv = child_command(command)
    out, err = sys.stdout.buffer, sys.stderr.buffer
    lock = threading.Lock()

    def note(message: str) -> None:
        with lock:
            err.write(f"[launch] {message}\n".encode())
            err.flush()

    procs: list[subprocess.Popen] = []
    exits: queue.Queue[tuple[int, int]] = queue.Queue()  # (process, return code), in exit order
    threads: list[threading.Thread] = []
    code = 0
    # Each process leads its own session (so that a signal for one reaches all it started):
    # a signal that stops the launcher must end them here, or they would outlive it.
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, _raise_stopped)
    try:
        for i in range(num_processes):
            child_env = process_env(
                base,
                process_id=i,
                num_processes=num_processes,
                port=port,
                devices_per_process=devices_per_process,
            )
            p = subprocess.Popen(
                argv,
                env=child_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            procs.append(p)
            waiter = threading.Thread(target=lambda i=i, p=p: exits.put((i, p.wait())), daemon=True)
            waiter.start()
            for stream, sink in ((p.stdout, out), (p.stderr, err)):
                assert stream is not None
                t = threading.Thread(
                    target=_forward, args=(stream, f"[{i}] ".encode(), sink, lock), daemon=True
                )
                t.start()
                threads.append(t)
        deadline = None if timeout is None else time.monotonic() + timeout
        remaining = num_processes
        while remaining:
            try:
                # Short waits: a blocking `get` would hold off Ctrl-C and the timeout.
                i, returncode = exits.get(timeout=_POLL_S)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    note(f"the run took longer than --timeout {timeout:g} s; ending every process")
                    code = TIMEOUT_EXIT
                    break
                continue
            remaining -= 1
            if returncode != 0:
                code = _exit_code(returncode)
                others = f"ending the {remaining} still running" if remaining else "none left"
                note(f"process {i} exited with code {returncode}; {others}")
                break
    except KeyboardInterrupt:
        note("interrupted; ending every process")
        code = INTERRUPT_EXIT
    except _Stopped as e:
        note(f"got {e}; ending every process")
        code = 128 + e.signum
    finally:
        _end_all(procs, grace)
        for t in threads:
            t.join(timeout=grace)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eqxshard.launch",
        description=(
            "Run a script as N processes of one JAX run on this machine (gloo collectives "
            "on 127.0.0.1), as a cluster would. The script calls `eqxshard.initialize()`."
        ),
        epilog="example: python -m eqxshard.launch -n 2 --devices-per-process 4 -- train.py",
    )
    parser.add_argument("-n", "--num-processes", type=int, required=True, help="processes")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="CPU devices for each process (runs on the CPU); default: leave it to JAX",
    )
    parser.add_argument(
        "--port", type=int, default=None, help="coordinator port (default: a free one)"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="end the run after this many seconds"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=GRACE_S,
        help=f"seconds from SIGTERM to SIGKILL when ending processes (default {GRACE_S:g})",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py [args ...]")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: `python -m eqxshard.launch -n N [options] -- script.py [args]`."""
    parser = _parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("no command given: add `-- script.py [args ...]`")
    try:
        return launch(
            command,
            num_processes=args.num_processes,
            devices_per_process=args.devices_per_process,
            port=args.port,
            timeout=args.timeout,
            grace=args.grace,
        )
    except ValueError as e:
        parser.error(str(e))
    except OSError as e:  # the command could not be started
        print(f"[launch] cannot run {command[0]!r}: {e}", file=sys.stderr)
        return 127
