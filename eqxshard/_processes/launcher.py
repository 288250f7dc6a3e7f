"""`python -m eqxshard.launch`: the processes of one run, on this machine or on several
hosts, restarted after a failure when asked.

On this machine (`-n N`), each process gets the variables `eqxshard.initialize()` reads
(see `children.run_variables`): the coordinator on 127.0.0.1 and a free port, the
process count and its own id, plus JAX's own variables for CPU devices and gloo
collectives. On hosts (`--hosts` / `--hostfile`, K processes each), each process is
started through the remote template (default `ssh -o BatchMode=yes {host}`) as
`env VARIABLES... python /abs/script.py ARGS` (see `hosts.py`), with the coordinator on
the first host.

The launcher forwards every line the processes print with a `[k] ` prefix, and ends the
run as one: when a process exits with an error, the others are ended too (SIGTERM, then
SIGKILL after a grace period). With `max_restarts`, the run is then started again (a
script that resumes from its newest checkpoint carries on); otherwise the launcher
exits with that process's code. Only processes the launcher started (and whatever they
started) are ever signalled. The launcher never starts a JAX backend of its own.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from .attempt import (
    INTERRUPT_EXIT as INTERRUPT_EXIT,
    TIMEOUT_EXIT as TIMEOUT_EXIT,
    Start,
    run_attempt,
)
from .children import (
    GRACE_S,
    child_command as child_command,
    free_port as free_port,
    process_env as process_env,
    run_variables,
)
from .hosts import (
    DEFAULT_REMOTE,
    check_hosts,
    check_template,
    default_port,
    placements,
    read_hostfile,
    remote_argv,
    script_command,
)
from .launcher_args import _check_arguments, _check_hosts_arguments, _parser


def _starts(
    command: Sequence[str],
    *,
    num_processes: int,
    hosts: Sequence[str] | None,
    processes_per_host: int,
    template: list[str],
    port: int,
    base: Mapping[str, str],
    restart: int,
    variables: dict[str, int | None],
) -> list[Start]:
    """How to start each process of one attempt."""
    starts = []
    coordinator_host = "127.0.0.1" if hosts is None else hosts[0]
    for place in placements(hosts, num_processes):
        run = run_variables(
            process_id=place.process_id,
            num_processes=num_processes,
            coordinator=f"{coordinator_host}:{port}",
            hosts=hosts,
            processes_per_host=processes_per_host if hosts is not None else None,
            restart=restart,
            **variables,  # pyright: ignore[reportArgumentType]
        )
        if place.host is None:
            env = {**base, **run}
            starts.append(Start(place.process_id, child_command(command), env, None))
        else:
            argv = remote_argv(template, place.host, run, script_command(command))
            starts.append(Start(place.process_id, argv, dict(base), place.host))
    return starts


def launch(
    command: Sequence[str],
    *,
    num_processes: int | None = None,
    hosts: Sequence[str] | None = None,
    processes_per_host: int = 1,
    devices_per_process: int | None = None,
    remote: str = DEFAULT_REMOTE,
    port: int | None = None,
    max_restarts: int = 0,
    heartbeat_timeout: int | None = None,
    initialization_timeout: int | None = None,
    timeout: float | None = None,
    grace: float = GRACE_S,
    env: Mapping[str, str] | None = None,
) -> int:
    """Runs `command` as the processes of one run: on this machine, or on `hosts`.

    **Arguments:**

    - `command`: the command of every process: `["script.py", *args]` and
      `["-m", "module", *args]` run with this Python (on hosts: `sys.executable` and the
      script's absolute path, which must exist there too).
    - `num_processes`: how many processes on this machine. With `hosts`, `None` (or
      `len(hosts) * processes_per_host`).
    - `hosts`: host names; process `k` runs on `hosts[k // processes_per_host]`, process 0
      (the coordinator, at `hosts[0]:port`) on the first. `None` runs on this machine.
    - `processes_per_host`: processes on each host.
    - `devices_per_process`: CPU devices for each process (the run then uses the CPU
      only). `None` leaves the platform and device count to JAX.
    - `remote`: how to run a command on a host, `{host}` where the host goes. Each
      process runs as its words, then `env NAME=VALUE ...` and the command, each word
      quoted for a shell, as ssh passes them to the remote shell. A template exiting
      with 255 (ssh's code for "could not connect") before its process printed a line
      stops the run at once: that host cannot be started.
    - `port`: the coordinator's port. `None`: a free one on this machine; on hosts, a
      random one in 61440-65535. Restart `r` uses `port + r` (the processes of the
      attempt before may still hold `port` on a host ssh does not end them on).
    - `max_restarts`: after a process ends badly, end the others and start the run
      again, up to this many times (the script resumes from its checkpoint itself).
    - `heartbeat_timeout`, `initialization_timeout`: seconds, passed to each process's
      `eqxshard.initialize()` (see there); `None` leaves them to it.
    - `timeout`: seconds the whole run may take, restarts included; `None`: no limit.
    - `grace`: seconds between SIGTERM and SIGKILL when processes are ended. JAX catches
      SIGTERM and carries on, so a JAX process is ended by the SIGKILL, `grace` s later.
    - `env`: the environment of the processes on this machine (of the template's
      process on hosts) before the launcher's variables; `None` is this process's.

    **Returns:**

    The exit code: 0 if every process exited with 0; otherwise that of the process that
    failed last (128 + N if killed by signal N), 124 on timeout, 130 on Ctrl-C.

    **Raises:**

    - `TypeError`: if an argument has the wrong type (e.g. `command` a string).
    - `ValueError`: if `command` is empty, a count or `timeout` is not positive, `port`
      is not in 1..65535, `grace` or `max_restarts` is negative, `hosts` is empty or
      names a host twice, `remote` has no `{host}`, or `num_processes` disagrees with
      `hosts`.
    - `OSError`: if a process cannot be started (the program or template is missing);
      the message names the process and host. `FileNotFoundError`, before anything is
      started, if the script (`script.py`) of a run on this machine does not exist.
    """
    _check_hosts_arguments(
        hosts, processes_per_host, remote, max_restarts, heartbeat_timeout, initialization_timeout
    )
    if hosts is not None:
        check_hosts(hosts)
        total = len(hosts) * processes_per_host
        if num_processes is not None and num_processes != total:
            raise ValueError(
                f"`num_processes` is {num_processes}, but {len(hosts)} hosts x "
                f"{processes_per_host} processes per host make {total}: leave it out."
            )
        num_processes = total
    _check_arguments(command, num_processes, devices_per_process, port, timeout, grace, env)
    assert num_processes is not None
    if hosts is None and command[0].endswith(".py") and not os.path.exists(command[0]):
        raise FileNotFoundError(
            errno.ENOENT, f"no such script: {os.path.abspath(command[0])}; nothing was started"
        )
    template = check_template(remote) if hosts is not None else []
    base = dict(os.environ if env is None else env)
    out, err = sys.stdout.buffer, sys.stderr.buffer
    lock = threading.Lock()

    def note(message: str) -> None:
        with lock:
            err.write(f"[launch] {message}\n".encode())
            err.flush()

    first_port = port if port is not None else (default_port() if hosts else None)
    deadline = None if timeout is None else time.monotonic() + timeout
    variables: dict[str, int | None] = {
        "devices_per_process": devices_per_process,
        "heartbeat_timeout": heartbeat_timeout,
        "initialization_timeout": initialization_timeout,
    }
    restart = 0
    while True:
        if first_port is None:
            attempt_port = free_port()
        else:
            attempt_port = 1024 + (first_port - 1024 + restart) % (65536 - 1024)
        starts = _starts(
            command,
            num_processes=num_processes,
            hosts=hosts,
            processes_per_host=processes_per_host,
            template=template,
            port=attempt_port,
            base=base,
            restart=restart,
            variables=variables,
        )
        if hosts is not None:
            note(
                f"{num_processes} processes on {len(hosts)} hosts, coordinator "
                f"{hosts[0]}:{attempt_port}" + (f" (restart {restart})" if restart else "")
            )
        outcome = run_attempt(
            starts,
            out=out,
            err=err,
            lock=lock,
            note=note,
            deadline=deadline,
            timeout=timeout,
            grace=grace,
            remote=hosts is not None,
        )
        if outcome.kind != "failed" or restart >= max_restarts:
            if outcome.message:
                note(outcome.message)
            if outcome.kind == "failed" and max_restarts:
                note(f"no restarts left (--max-restarts {max_restarts}); the run failed")
            return outcome.code
        restart += 1
        note(f"{outcome.message}; restarting the run (restart {restart} of {max_restarts})")


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: `python -m eqxshard.launch (-n N | --hosts H,H | --hostfile F)
    [options] -- script.py [args]`."""
    parser = _parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("no command given: add `-- script.py [args ...]`")
    hosts = None
    if args.hosts is not None:
        hosts = args.hosts.split(",")
    elif args.hostfile is not None:
        try:
            hosts = read_hostfile(args.hostfile)
        except (OSError, ValueError) as e:
            parser.error(f"--hostfile: {e}")
    try:
        return launch(
            command,
            num_processes=args.num_processes,
            hosts=hosts,
            processes_per_host=args.processes_per_host,
            devices_per_process=args.devices_per_process,
            remote=args.remote,
            port=args.port,
            max_restarts=args.max_restarts,
            heartbeat_timeout=args.heartbeat_timeout,
            initialization_timeout=args.initialization_timeout,
            timeout=args.timeout,
            grace=args.grace,
        )
    except ValueError as e:
        parser.error(str(e))
    except OSError as e:  # the command or the template could not be started
        if hosts is None:
            print(f"[launch] cannot run {command[0]!r}: {e}", file=sys.stderr)
        else:
            print(f"[launch] {e}; stopping the run", file=sys.stderr)
        return 127
