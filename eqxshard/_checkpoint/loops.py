"""orbax's event loops, each one drained before it is closed.

orbax (0.12.5 and later) runs each of its coroutines (`asyncio_utils.run_sync`) on a new
event loop that it closes as soon as the coroutine ends, without waiting for the tasks the
coroutine left running. When one read of a step fails (a damaged array),
`asyncio.gather` raises at once and the other reads, each a tensorstore future awaited
by a task, are left running; tensorstore completes them later, on its own threads, and
calls back into the closed loop (`RuntimeError: Event loop is closed`, printed as
"Exception ignored"). The same holds for any orbax coroutine that fails while others run
beside it: a write of a failed save is not waited for. `drain_orbax_loops` has orbax's
runner wait for those tasks before it closes the loop. Earlier orbax versions run each
coroutine with `asyncio.run`, which cancels the tasks left running before it closes the
loop; they are left as they are.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")

# How long the tasks a failed coroutine left running may take to end on their own before
# they are cancelled (reads and writes of the other arrays; they only take longer when
# stuck, e.g. on a barrier of another process that is gone).
LEFT_RUNNING_S = 60.0

_INSTALLED: list[bool] = []
_LOCK = threading.Lock()


def drain_orbax_loops() -> None:
    """Has orbax's coroutine runner wait for the tasks a coroutine left running before it
    closes its event loop (see the module's docstring). Once per process, on the first
    import of orbax by a checkpoint verb; nothing changes on orbax versions that have no
    such runner."""
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED.append(True)
        from orbax.checkpoint._src import asyncio_utils

        if callable(getattr(asyncio_utils, "_run_sync_via_new_loop", None)):
            asyncio_utils._run_sync_via_new_loop = run_draining  # pyright: ignore[reportAttributeAccessIssue]


def run_draining(coro: Coroutine[Any, Any, _T]) -> _T:
    """Runs `coro` on a new event loop, as orbax's runner does (the loop is the thread's
    current one while it runs), then, before closing the loop, waits for the tasks made on
    it that are still running: up to `LEFT_RUNNING_S` seconds, then they are cancelled
    (at once if the run was stopped by `KeyboardInterrupt` or `SystemExit`). Returns the
    result of `coro` or raises its error."""
    loop = asyncio.new_event_loop()
    made: set[asyncio.Task] = set()

    def record(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        made.add(task)
        task.add_done_callback(made.discard)
        return task

    loop.set_task_factory(record)  # pyright: ignore[reportArgumentType]
    wait = LEFT_RUNNING_S
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    except (KeyboardInterrupt, SystemExit):
        wait = 0.0
        raise
    finally:
        try:
            _drain(loop, made, wait)
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _drain(loop: asyncio.AbstractEventLoop, made: set[asyncio.Task], wait: float) -> None:
    """Runs `loop` until every task of `made` has ended: for `wait` seconds on their own,
    then cancelled. A task awaiting a tensorstore future ends only once tensorstore's
    callback has reached the loop, so none is left to call into it once it is closed.
    Their errors are taken (the coroutine's own error is the one raised)."""
    deadline = time.monotonic() + wait
    ended: list[asyncio.Task] = []
    while left := [task for task in made if not task.done()]:
        remaining = deadline - time.monotonic()
        if remaining > 0:
            loop.run_until_complete(asyncio.wait(left, timeout=remaining))
        else:
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.wait(left))
        ended.extend(left)
    for task in ended:
        if task.done() and not task.cancelled():
            task.exception()  # taken: asyncio would log it as never retrieved
