"""This process's stderr through the watcher of `failures.py`, which adds an `eqxshard:`
line when the process ends because the run lost a peer; and what the watcher is told.

The watcher is started before `jax.distributed.initialize` (a peer that never joins is
reported from there), only in a run of several processes. It is a plain Python process
running `failures.py` by path (it never imports JAX: a few MB and milliseconds), reading
a pipe that replaces file descriptor 2 of this process: C++ log lines, Python tracebacks
and `print(..., file=sys.stderr)` all pass through it unchanged. It ends when the pipe
closes, i.e. when this process (and whatever it started with the same stderr) has ended.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .failures import CONTROL

# Turns the watcher off (`EQXSHARD_WATCH=0`): stderr stays as it is, and a lost peer ends
# this process with JAX's text only.
WATCH_VAR = "EQXSHARD_WATCH"
_STATE: dict[str, Any] = {}


def started() -> bool:
    return "watcher" in _STATE


def start(info: dict[str, Any]) -> bool:
    """Starts the watcher with what is known so far (`failures.explain`'s `info`).
    Returns whether it runs (not where `EQXSHARD_WATCH=0`, or stderr is closed)."""
    if started():
        tell(**info)
        return True
    if os.environ.get(WATCH_VAR, "1") == "0":
        return False
    try:
        original = os.dup(2)
    except OSError:
        return False
    read, write = os.pipe()
    script = Path(__file__).with_name("failures.py")
    try:
        watcher = subprocess.Popen(
            [sys.executable, "-S", "-E", str(script), json.dumps(info)],
            stdin=read,
            stdout=original,
            stderr=original,
            close_fds=True,
        )
    except OSError:
        for fd in (read, write, original):
            os.close(fd)
        return False
    os.close(read)
    sys.stderr.flush()
    os.dup2(write, 2)
    os.close(write)
    os.close(original)
    _STATE["watcher"] = watcher
    return True


def tell(**update: Any) -> None:
    """Tells the watcher what it will need if the run fails (no-op without a watcher)."""
    if not started():
        return
    line = CONTROL + json.dumps(update).encode() + b"\n"
    sys.stderr.flush()
    try:
        os.write(2, line)  # one write: atomic on a pipe up to PIPE_BUF (4 KiB)
    except OSError:
        pass
