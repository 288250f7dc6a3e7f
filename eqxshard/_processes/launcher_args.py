"""Checks of the launcher's arguments and its command line (`python -m eqxshard.launch`)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import TypeGuard

from .children import GRACE_S
from .hosts import DEFAULT_REMOTE


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
