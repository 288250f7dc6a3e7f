"""`python -m eqxshard.launch`: N processes of one script on this machine, as a cluster would.

Each process gets the variables `eqxshard.initialize()` reads (see `initialize.py`): the
coordinator on 127.0.0.1 and a free port, the process count and its own id, plus JAX's
own variables for CPU devices and gloo collectives. The launcher forwards every line the
processes print with a `[i] ` prefix, and ends the run as one: when a process exits with
an error, the others are ended too (SIGTERM, then SIGKILL after a grace period), and the
launcher exits with that process's code. Only processes the launcher started (and
whatever they started) are ever signalled.

The launcher never starts a JAX backend of its own: it runs no JAX computation.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from .children import (
    _POLL_S,
    GRACE_S,
    _end_all,
    _exit_code,
    _forward,
    _raise_stopped,
    _Stopped,
    child_command,
    free_port,
    process_env,
)
from .launcher_args import _check_arguments, _parser

# Exit codes of the launcher itself, as `timeout` and shells use them.
TIMEOUT_EXIT = 124
INTERRUPT_EXIT = 130


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
