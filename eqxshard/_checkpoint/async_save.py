"""`AsyncSave`, the save `filter_save` started: waiting for it, at exit too, and cleaning
up after a failed one (orbax's temporary directory, its threads left waiting)."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax

from .store import damage


class AsyncSave:
    """A save started by `filter_save`; `wait()` blocks until it is on disk.

    With `filter_save(..., wait=True)` (the default) the save is already finished when
    this is returned. Every process must call `wait()` (it ends with a barrier across
    processes). Saves still running when Python exits normally are finished before it
    exits (see `filter_save`).
    """

    def __init__(self, manager: Any, directory: str, step: int):
        self.directory, self.step = directory, step
        self._manager: Any = manager
        self._lock = threading.Lock()
        self._interrupted = False  # its `wait()` was stopped by Ctrl-C

    def wait(self) -> None:
        """Blocks until the checkpoint is written and committed (a no-op once it is).

        If the write failed, raises its error; the partial step is removed. If the step
        is not complete on disk once committed (e.g. another process saved the same step
        into the directory at the same time), raises `OSError` saying so. Interrupted by
        Ctrl-C (`KeyboardInterrupt`), the save goes on running, as one of `wait=False`:
        `wait()` again, the next `filter_save` to the directory or the exit of Python
        finishes it.
        """
        with self._lock:
            if self._manager is None:
                return
            manager, self._manager = self._manager, None
        try:
            _wait_for(manager, self.directory, self.step)
        except KeyboardInterrupt:
            # Ctrl-C: orbax's threads go on writing. The save stays running, as one of
            # `wait=False`: the next save to the directory, a later `wait()` or the exit
            # of Python finishes it (a step is never left half-written by its threads
            # being stopped at exit).
            with self._lock:
                self._manager, self._interrupted = manager, True
            raise
        except BaseException:
            # No `manager.close()`: in a run of several processes it waits at a barrier
            # for the others, which wait for this process's part of the save.
            if _PENDING.get(self.directory) is self:
                del _PENDING[self.directory]
            release_waiting_threads()
            remove_partial(self.directory, self.step)
            raise
        try:
            manager.close()
        finally:
            if _PENDING.get(self.directory) is self:
                del _PENDING[self.directory]
        # Process 0 committed the step (renamed its directory); another host may not see
        # that yet through its filesystem's caches (NFS), so it does not check.
        problem = damage(self.directory, self.step) if jax.process_index() == 0 else None
        if problem is not None:
            raise OSError(
                f"`filter_save` wrote step {self.step} to {self.directory}, but the step is "
                f"not complete on disk ({problem}). Another process or run may have saved "
                "the same step into this directory at the same time, or the directory was "
                "changed during the save. The step does not count (`latest_step` skips "
                f"it): delete {os.path.join(self.directory, str(self.step))} and save again."
            )
        for hook in ON_COMPLETE:
            hook(self.directory, self.step)

    def done(self) -> bool:
        """Whether the write has finished (without waiting, and without committing)."""
        manager = self._manager
        return manager is None or not manager.is_saving_in_progress()

    def __repr__(self) -> str:
        state = "done" if self.done() else "in progress"
        return f"AsyncSave(directory={self.directory!r}, step={self.step}, {state})"


# Called with (directory, step) once a save is on disk: how a run of several processes
# knows its newest complete checkpoint when it loses a peer (`_processes/joining.py`).
ON_COMPLETE: list[Callable[[str, int], None]] = []
# directory -> its save still being written; a new save to a directory waits for it.
_PENDING: dict[str, AsyncSave] = {}
_AT_EXIT: list[bool] = []


def _future_error(future: Any, depth: int = 0) -> BaseException | None:
    """The error of a failed writer thread among orbax's commit `future`s (which only
    report it once every process is done), if any."""
    if future is None or depth > 4:
        return None
    if isinstance(future, list | tuple):
        for f in future:
            if (error := _future_error(f, depth + 1)) is not None:
                return error
        return None
    error = getattr(getattr(future, "_t", None), "_exception", None)
    if isinstance(error, BaseException):
        return error
    return _future_error(getattr(future, "_futures", None), depth + 1)


def capture_write_errors(manager: Any) -> None:
    """Keeps the error of this process's write where `_wait_for` sees it: orbax's thread
    that finishes the save takes it from the writer, then waits at a barrier for the
    other processes before it reports it."""
    checkpointer = getattr(manager, "_checkpointer", None)
    wait = getattr(checkpointer, "wait_until_finished", None)
    if wait is None:
        return

    def wait_until_finished() -> None:
        try:
            wait()
        except BaseException as e:
            checkpointer._eqxshard_error = e  # pyright: ignore[reportOptionalMemberAccess]
            raise

    checkpointer.wait_until_finished = wait_until_finished  # pyright: ignore[reportOptionalMemberAccess]


def _wait_for(manager: Any, directory: str, step: int) -> None:
    """`manager.wait_until_finished()`, except that a failed write of this process is
    raised at once: orbax would first wait at a barrier for the other processes, which
    wait for this one's part, until its timeout (minutes)."""
    # orbax's writer of this process (with the error it keeps once it failed), and the
    # thread that finishes the save (it writes through the writer, then commits).
    checkpointer = getattr(manager, "_checkpointer", None)
    finalize = getattr(manager, "_finalize_thread", None)
    while True:
        writer = getattr(checkpointer, "_async_manager", None)
        error = (
            getattr(writer, "_exception", None)
            or _future_error(getattr(writer, "_commit_futures", None))
            or getattr(checkpointer, "_eqxshard_error", None)
        )
        if isinstance(error, BaseException):
            raise OSError(
                f"`filter_save` could not write step {step} to {directory} (process "
                f"{jax.process_index()}): {type(error).__name__}: {error}"
            ) from error
        thread = getattr(finalize, "get", lambda: None)()
        if not isinstance(thread, threading.Thread) or not thread.is_alive():
            break
        threading.Thread.join(thread, timeout=0.05)  # orbax's `join` would raise
    manager.wait_until_finished()


def remove_partial(directory: str, step: int) -> None:
    """Removes what a failed save of `step` left behind: orbax's temporary directory."""
    if "://" in directory or not os.path.isdir(directory):
        return
    prefix = f"{step}.orbax-checkpoint-tmp"
    for name in os.listdir(directory):
        if name.startswith(prefix):
            path = os.path.join(directory, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.remove(path)
                except OSError:
                    pass


def remove_leftovers(directory: str, step: int) -> None:
    """Removes the temporary directories of saves of steps before `step` that were killed
    (they never count; orbax's `max_to_keep` never removes them, or removes one of them
    in place of a step)."""
    if "://" in directory or not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        number, dot, rest = name.partition(".")
        if dot and rest.startswith("orbax-checkpoint-tmp") and number.isdigit():
            if int(number) < step:
                remove_partial(directory, int(number))


def release_waiting_threads() -> None:
    """After a failed save, wakes orbax's writer threads that still wait for the step
    directory to be created (otherwise each waits out orbax's timeout, minutes, and holds
    up the exit of Python). Woken, they find no directory and end."""
    try:
        from orbax.checkpoint._src.futures import future, synchronization

        signals = synchronization.HandlerAwaitableSignal
        future.set_signals(
            [signals.STEP_DIRECTORY_CREATION, signals.ITEM_DIRECTORY_CREATION],
            operation_id=synchronization.OperationIdGenerator.get_current_operation_id(),
        )
    except Exception:  # another orbax version: its threads time out as before
        pass


def finish_running_save(directory: str) -> None:
    """Waits for the save still being written to `directory`, if any: a new save to a
    directory first finishes the one before (raising its error, if it failed)."""
    pending = _PENDING.get(directory)
    if pending is not None:
        pending.wait()


def track_running_save(save: AsyncSave) -> None:
    """Registers `save`, just started, as the one being written to its directory: the next
    save there, `unfinished_saves` and the exit of Python wait for it. `save.wait()`
    unregisters it."""
    _PENDING[save.directory] = save


def unfinished_saves() -> list[AsyncSave]:
    """The background saves still being written."""
    return [pending for pending in _PENDING.values() if pending._manager is not None]


def _wait_all() -> None:
    """Finishes every running save at exit, saying loudly which ones failed."""
    for pending in list(_PENDING.values()):
        if pending._interrupted and pending._manager is not None:
            print(
                f"eqxshard: finishing the save of step {pending.step} to {pending.directory} "
                "(its wait was interrupted) before Python exits.",
                file=sys.stderr,
                flush=True,
            )
        try:
            pending.wait()
        except BaseException as e:
            print(
                f"eqxshard: the background save of step {pending.step} to "
                f"{pending.directory} failed at exit and is NOT on disk: "
                f"{type(e).__name__}: {e}",
                file=sys.stderr,
                flush=True,
            )


def wait_at_exit() -> None:
    """Finishes running saves when Python exits, registered on the first save.

    They must finish before Python shuts down the thread pools orbax writes with
    (`concurrent.futures` refuses new work once that began: a plain `atexit` handler is
    too late). Threading's own exit hooks run before that, last registered first, so
    this one (registered after orbax imported `concurrent.futures`) runs before the
    pools stop; it also runs before the `atexit` handler of `jax.distributed` (the
    saves end with a barrier across processes).
    """
    if _AT_EXIT:
        return
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError
        register(_wait_all)
    except RuntimeError:  # no such hook, or Python is already shutting down
        atexit.register(_wait_all)
    _AT_EXIT.append(True)
