"""Checks of the launcher's arguments and its command line (`python -m eqxshard.launch`)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import TypeGuard

from .children import GRACE_S


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
