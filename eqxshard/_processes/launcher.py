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
from collections.abc import Callable, Mapping, Sequence

from .attempt import (
    INTERRUPT_EXIT as INTERRUPT_EXIT,
    TIMEOUT_EXIT as TIMEOUT_EXIT,
    Outcome,
    run_attempt,
)
from .children import (
    GRACE_S,
    child_command as child_command,
    free_port as free_port,
    process_env as process_env,
)
from .hosts import DEFAULT_REMOTE, check_hosts, check_template, default_port, read_hostfile
from .launcher_args import _check_arguments, _check_hosts_arguments, _check_min_hosts, _parser
from .membership import PROBE_S, Membership, attempt_starts, probe


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
    min_hosts: int | None = None,
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
      stops the run at once (without `min_hosts`): that host cannot be started.
    - `port`: the coordinator's port. `None`: a free one on this machine; on hosts, a
      random one in 61440-65535. Restart `r` uses `port + r` (the processes of the
      attempt before may still hold `port` on a host ssh does not end them on).
    - `max_restarts`: after a process ends badly, end the others and start the run
      again, up to this many times (the script resumes from its checkpoint itself).
    - `min_hosts`: with `hosts`, the fewest hosts the run may go on with. A host that
      cannot be started again (before a restart, the template cannot run `true` there
      within 30 s; its start fails with 255; or its process, whose failure caused the
      restart, fails again before joining the run) is left out, and the run goes on
      with the processes of the others (renumbered; `initialize()` reads the new count),
      as long as at least `min_hosts` remain; else the run stops. Before each restart
      every host left out is tried again and taken in if it answers (one whose process
      failed at start-up twice stays out). Each is said in a `[launch]` line, and how
      long the run took to be back (every process joined) after a failure. `None`:
      every host (a host that cannot be started stops the run).
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
      names a host twice, `remote` has no `{host}`, `num_processes` disagrees with
      `hosts`, or `min_hosts` is given without `hosts` or is not in 1..`len(hosts)`.
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
    _check_min_hosts(min_hosts, hosts)
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
    members = Membership(list(hosts or []), min_hosts or len(hosts or []), processes_per_host)
    # `restart` counts the restarts after failures (`--max-restarts`); `attempt` every start
    # (also those again at once without a host that could not be started).
    restart = attempt = 0
    lost: Outcome | None = None  # the failure the attempt after it recovers from
    while True:
        if first_port is None:
            attempt_port = free_port()
        else:
            attempt_port = 1024 + (first_port - 1024 + attempt) % (65536 - 1024)
        current = members.current() if hosts is not None else None
        starts = attempt_starts(
            command,
            num_processes=num_processes if current is None else len(current) * processes_per_host,
            hosts=current,
            processes_per_host=processes_per_host,
            template=template,
            port=attempt_port,
            base=base,
            restart=attempt,
            variables=variables,
        )
        if current is not None:
            note(
                f"{len(starts)} processes on {len(current)} hosts, coordinator "
                f"{current[0]}:{attempt_port}" + (f" (restart {restart})" if restart else "")
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
            on_joined=None if lost is None else _back(note, lost, len(starts), current),
        )
        attempt += 1
        if outcome.kind == "unstarted" and members.shrinks and outcome.host is not None:
            note(members.leave_out(outcome.host, f"it cannot be started: {outcome.why}"))
            if not members.enough():
                note(members.too_few())
                return outcome.code
            continue  # at once, without it: no restart used
        if outcome.kind == "failed" and members.shrinks and outcome.host is not None:
            if lost is not None and lost.host == outcome.host and not outcome.joined:
                why = (
                    f"it failed again at start-up ({outcome.why}, before joining the run); "
                    "it stays out for the rest of the run"
                )
                note(members.leave_out(outcome.host, why, for_good=True))
                if not members.enough():
                    note(members.too_few())
                    return outcome.code
        if outcome.kind != "failed" or restart >= max_restarts:
            if outcome.message:
                note(outcome.message)
            if outcome.kind == "failed" and max_restarts:
                note(f"no restarts left (--max-restarts {max_restarts}); the run failed")
            return outcome.code
        restart += 1
        lost = outcome
        note(f"{outcome.message}; restarting the run (restart {restart} of {max_restarts})")
        if members.shrinks:
            for line in members.refresh(probe(template, members.to_probe(), base, PROBE_S)):
                note(line)
            if not members.enough():
                note(members.too_few())
                return outcome.code


def _back(note: Callable[[str], None], lost: Outcome, processes: int, hosts: list[str] | None):
    """What the launcher says once every process of a restarted run joined it."""

    def said() -> None:
        where = f" on {len(hosts)} hosts" if hosts is not None else ""
        note(
            f"the run is back {time.monotonic() - lost.since:.1f} s after {lost.why}: "
            f"{processes} processes{where} joined it"
        )

    return said


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
            min_hosts=args.min_hosts,
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
