"""Bad inputs to the launcher (`eqxshard._launch.launch`, which `python -m eqxshard.launch`
calls with its parsed command line) and to `initialize`. Every one is refused before any
process is started or any run is joined."""

# Every case passes a bad argument on purpose, to check the error it raises: what a type
# checker says about those arguments is the point of this file, not a mistake in it.
# pyright: reportArgumentType=false, reportCallIssue=false

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import eqxshard
from eqxshard._processes import launcher as _launch

from . import Case


def _launch_with(**kwargs: Any) -> Callable[[], Any]:
    arguments: dict[str, Any] = {"command": ["x.py"], "num_processes": 2, **kwargs}
    return lambda: _launch.launch(**arguments)


def _initialize_with_env(**env: str) -> Callable[[], Any]:
    """`initialize()` with the launcher's variables set to `env` (restored after)."""

    def call() -> Any:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return eqxshard.initialize()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return call


CASES: list[Case] = [
    Case("launch/command-empty", _launch_with(command=[]), ValueError, "`command` is empty"),
    Case(
        "launch/command-string",
        _launch_with(command="train.py"),
        TypeError,
        "`command` must be a list of strings",
    ),
    Case(
        "launch/command-not-strings",
        _launch_with(command=["train.py", 3]),
        TypeError,
        "`command` must be a list of strings",
    ),
    Case(
        "launch/num_processes-zero",
        _launch_with(num_processes=0),
        ValueError,
        "`num_processes` must be at least 1",
    ),
    Case(
        "launch/num_processes-float",
        _launch_with(num_processes=2.0),
        TypeError,
        "`num_processes` must be an int",
    ),
    Case(
        "launch/devices_per_process-zero",
        _launch_with(devices_per_process=0),
        ValueError,
        "`devices_per_process` must be at least 1",
    ),
    Case(
        "launch/port-out-of-range",
        _launch_with(port=70000),
        ValueError,
        "`port` must be a TCP port in 1..65535",
    ),
    Case("launch/port-str", _launch_with(port="1234"), TypeError, "`port` must be an int"),
    Case("launch/timeout-zero", _launch_with(timeout=0), ValueError, "`timeout` must be positive"),
    Case("launch/timeout-str", _launch_with(timeout="10"), TypeError, "`timeout` must be a number"),
    Case("launch/grace-negative", _launch_with(grace=-1), ValueError, "`grace` must be >= 0"),
    Case("launch/env-list", _launch_with(env=["A=1"]), TypeError, "`env` must be a mapping"),
    Case(
        "initialize/initialization_timeout-float",
        lambda: eqxshard.initialize(initialization_timeout=2.5),
        TypeError,
        "`initialization_timeout`",
    ),
    Case(
        "initialize/heartbeat_timeout_seconds-zero",
        lambda: eqxshard.initialize(heartbeat_timeout_seconds=0),
        ValueError,
        "`heartbeat_timeout_seconds` >= 1",
    ),
    Case(
        "initialize/exit_on_error-str",
        lambda: eqxshard.initialize(exit_on_error="yes"),
        TypeError,
        "`exit_on_error`",
    ),
    Case(
        "initialize/process-id-not-int",
        _initialize_with_env(
            EQXSHARD_PROCESS_ID="zero",
            EQXSHARD_NUM_PROCESSES="2",
            JAX_COORDINATOR_ADDRESS="127.0.0.1:1",
        ),
        ValueError,
        "EQXSHARD_PROCESS_ID='zero' is not an integer",
    ),
]
