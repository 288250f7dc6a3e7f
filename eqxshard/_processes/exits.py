"""Ending a process of a multi-process run at once when it fails: an uncaught exception
or a non-zero `SystemExit` would otherwise wait in JAX's shutdown barrier for the other
processes, which wait for it in their next collective (see `initialize`'s
`exit_on_error`).
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any

import jax


def _end_now(code: int, why: str) -> None:
    """Ends this process at once with `code`, skipping JAX's shutdown barrier (which would
    wait for processes that themselves wait for this one in a collective)."""
    try:
        from .._checkpoint.async_save import unfinished_saves

        for save in unfinished_saves():
            print(
                f"eqxshard: the background save of step {save.step} to {save.directory} is "
                "NOT finished (the process ends at once on an error).",
                file=sys.stderr,
            )
        print(
            f"eqxshard: process {jax.process_index()} ended by {why} (exit code {code}), "
            "without waiting for the other processes.",
            file=sys.stderr,
        )
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(code)


def _exit_on_uncaught(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """`sys.excepthook` of a multi-process run: the traceback, then an immediate exit."""
    try:
        traceback.print_exception(kind, value, tb)
    finally:
        _end_now(1, f"an uncaught {kind.__name__}")


def _status_code(status: Any) -> int:
    """The exit code Python gives `sys.exit(status)` (a message is printed, code 1)."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status & 0xFF
    return 1


class _Exit(SystemExit):
    """What `sys.exit` raises in a multi-process run: a `SystemExit` like any other
    (catchable, same `code`), except when it reaches the top of the program with a
    non-zero code: Python reads `code` then, with no Python frame left on the stack, and
    the process ends at once instead of waiting in JAX's shutdown barrier."""

    @property
    def code(self) -> Any:  # pyright: ignore[reportIncompatibleVariableOverride]
        status = self.__dict__.get("_code", self.args[0] if len(self.args) == 1 else None)
        if len(self.args) > 1 and "_code" not in self.__dict__:
            status = self.args
        frame = sys._getframe()
        if frame.f_back is None and _status_code(status) != 0:
            if not isinstance(status, int):
                print(status, file=sys.stderr)
            _end_now(_status_code(status), f"SystemExit({status!r})")
        return status

    @code.setter
    def code(self, value: Any) -> None:  # pyright: ignore[reportIncompatibleVariableOverride]
        self.__dict__["_code"] = value


def _exit(status: Any = None) -> None:
    raise _Exit(status)


_exit.__doc__ = sys.exit.__doc__


def _watch_system_exit() -> bool:
    """On Python 3.12+, ends this process at once when a `SystemExit` with a non-zero code
    leaves the outermost Python frame of the main thread (nothing can catch it there):
    `sys.exit(n)` and `raise SystemExit(n)` alike, with `sys.exit` left as it is.

    Uses `sys.monitoring`'s `PY_UNWIND` event (a global event: the callback returns at
    once for every frame but the outermost). Returns whether it is installed: not on
    Python 3.11, off the main thread, or when every free tool id is taken.
    """
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None or threading.current_thread() is not threading.main_thread():
        return False
    frame = sys._getframe()
    while frame.f_back is not None:
        frame = frame.f_back
    outermost = frame.f_code
    for tool in (4, 3):  # the ids `sys.monitoring` leaves to tools other than its named ones
        if monitoring.get_tool(tool) is None:
            break
    else:
        return False
    events = monitoring.events

    def unwind(code: Any, offset: int, exception: BaseException) -> Any:
        if code is not outermost or not isinstance(exception, SystemExit):
            return None
        end_on_system_exit(exception.code)

    monitoring.use_tool_id(tool, "eqxshard")
    monitoring.register_callback(tool, events.PY_UNWIND, unwind)
    monitoring.set_events(tool, monitoring.get_events(tool) | events.PY_UNWIND)
    return True


def end_on_system_exit(status: Any) -> None:
    """Ends this process at once for a `SystemExit(status)` that left the program, unless
    its code is 0 (then Python exits as usual, waiting for the others)."""
    if _status_code(status) == 0:
        return
    if not isinstance(status, int):
        print(status, file=sys.stderr)
    _end_now(_status_code(status), f"SystemExit({status!r})")


_PROMPT = False  # whether `end_promptly_on_errors` ran in this process


def ends_promptly() -> bool:
    """Whether an uncaught error ends this process at once (`initialize` joined a run of
    several processes with `exit_on_error=True`): read by `run_main.py`."""
    return _PROMPT


def end_promptly_on_errors() -> None:
    """Makes an uncaught exception and an uncaught `SystemExit` with a non-zero code end
    this process at once. On Python 3.11, `sys.exit(n)` only (see `_Exit`), and
    `raise SystemExit(n)` too where the launcher started the process (`run_main.py`)."""
    global _PROMPT
    _PROMPT = True
    sys.excepthook = _exit_on_uncaught
    if not _watch_system_exit():
        sys.exit = _exit
