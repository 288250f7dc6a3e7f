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

import argparse
import errno
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeGuard

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
            if outcome.kind == "unstarted" and hosts is not None and outcome.host is not None:
                # Every host is needed (`min_hosts` is the host count): say that it is the
                # minimum the run fell below, as a run that may shrink says it.
                members.leave_out(outcome.host, f"it cannot be started: {outcome.why}")
                note(members.too_few())
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


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_count(name: str, value: object, *, optional: bool, least: int = 1) -> None:
    if value is None and optional:
        return
    if not _is_int(value):
        kind = "an int or None" if optional else "an int"
        raise TypeError(f"`{name}` must be {kind}, but got {type(value).__name__} {value!r}.")
    if value < least:
        raise ValueError(f"`{name}` must be at least {least}, got {value}.")


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
    _check_count("num_processes", num_processes, optional=False)
    _check_count("devices_per_process", devices_per_process, optional=True)
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


def _check_hosts_arguments(
    hosts: object,
    processes_per_host: object,
    remote: object,
    max_restarts: object,
    heartbeat_timeout: object,
    initialization_timeout: object,
) -> None:
    """The checks of `launch`'s arguments for runs on several hosts, restarts and bounds."""
    if hosts is not None:
        if isinstance(hosts, str | bytes) or not isinstance(hosts, Sequence):
            raise TypeError(
                "`hosts` must be a list of host names, e.g. `['node1', 'node2']`, but got "
                f"{type(hosts).__name__} {hosts!r}."
            )
        if not all(isinstance(h, str) for h in hosts):
            raise TypeError(f"`hosts` must be a list of strings, but got {list(hosts)!r}.")
    _check_count("processes_per_host", processes_per_host, optional=False)
    if not isinstance(remote, str):
        raise TypeError(
            f"`remote` must be a string such as {DEFAULT_REMOTE!r}, but got "
            f"{type(remote).__name__}."
        )
    _check_count("max_restarts", max_restarts, optional=False, least=0)
    _check_count("heartbeat_timeout", heartbeat_timeout, optional=True)
    _check_count("initialization_timeout", initialization_timeout, optional=True)


def _check_min_hosts(min_hosts: object, hosts: Sequence[str] | None) -> None:
    """`min_hosts`: `None`, or an int in 1..len(hosts) with `hosts` given."""
    if min_hosts is None:
        return
    _check_count("min_hosts", min_hosts, optional=False)
    if hosts is None:
        raise ValueError(
            f"`min_hosts` ({min_hosts}) is for runs on hosts: give `hosts` (`--hosts` or "
            "`--hostfile`), or leave it out."
        )
    if min_hosts > len(hosts):  # type: ignore[operator]
        raise ValueError(
            f"`min_hosts` is {min_hosts}, but the run has {len(hosts)} hosts: give at most "
            f"{len(hosts)} (the run goes on while at least `min_hosts` hosts can be started)."
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eqxshard.launch",
        description=(
            "Run a script as the processes of one JAX run: N processes on this machine "
            "(gloo collectives on 127.0.0.1), or K processes on each of several hosts, "
            "started through ssh (or --remote). The script calls `eqxshard.initialize()`."
        ),
        epilog=(
            "examples: python -m eqxshard.launch -n 2 --devices-per-process 4 -- train.py | "
            "python -m eqxshard.launch --hosts node1,node2 --processes-per-host 1 "
            "--max-restarts 3 -- train.py --resume"
        ),
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("-n", "--num-processes", type=int, help="processes on this machine")
    where.add_argument("--hosts", help="comma-separated hosts: process 0 runs on the first")
    where.add_argument("--hostfile", help="a file of hosts, one per line (# comments)")
    parser.add_argument(
        "--processes-per-host",
        type=int,
        default=1,
        help="processes on each host, with --hosts or --hostfile (default 1)",
    )
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="CPU devices for each process (runs on the CPU); default: leave it to JAX",
    )
    parser.add_argument(
        "--remote",
        default=DEFAULT_REMOTE,
        help=f"how to run a command on a host, {{host}} filled in (default: {DEFAULT_REMOTE!r})",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="coordinator port (default: a free one here; a random one in 61440-65535 on hosts)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="start the run again after a process fails, up to this many times (default 0)",
    )
    parser.add_argument(
        "--min-hosts",
        type=int,
        default=None,
        help="with --hosts/--hostfile: go on without hosts that cannot be started (again, "
        "at a restart of --max-restarts) while at least this many remain; a host that "
        "answers again is taken in at a later restart (default: all hosts)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=None,
        help="seconds without a heartbeat after which a process is taken as lost "
        "(default: initialize's, JAX's 100)",
    )
    parser.add_argument(
        "--initialization-timeout",
        type=int,
        default=None,
        help="seconds every process has to join at start-up (default: initialize's, JAX's 300)",
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
