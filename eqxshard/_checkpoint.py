"""Sharded checkpoints through `orbax-checkpoint`: `filter_save` and `latest_step`.

Only the array leaves are saved, each with its sharding, keyed by its dotted path
(`layers.0.weight`, as `describe` prints it and `path_rules` matches it). Non-array
leaves (activation functions, static fields) are never written: `filter_restore` takes
them from a `like` tree, e.g. `eqx.filter_eval_shape` of the model's constructor, and
reads each array straight into the layout it is asked for, which may be another mesh
or another number of processes than at save time. Every process reads only its own
devices' shards; no whole array is gathered on a host.

`orbax-checkpoint` is an optional dependency (`pip install eqxshard[checkpoint]`),
imported on first use only. `filter_restore` is in `_restore.py`.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from . import _compat
from ._rules import dotted_path
from ._tree import Flat, leaf_error, pathstr


def _orbax(verb: str) -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            f"`{verb}` needs the `orbax-checkpoint` package, which is not installed. "
            "Install it with `pip install eqxshard[checkpoint]`."
        ) from e
    return ocp


def _directory(directory: Any, verb: str) -> str:
    if not isinstance(directory, str | os.PathLike):
        raise TypeError(
            f"`{verb}` takes a `directory` as a `str` or `os.PathLike`, but got "
            f"{type(directory).__name__}."
        )
    directory = os.fspath(directory)
    # orbax wants absolute paths; URLs (`gs://...`) are left as they are.
    return directory if "://" in directory else os.path.abspath(directory)


def _step(step: Any, verb: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer):
        raise TypeError(f"`{verb}` takes an int `step`, but got {type(step).__name__}.")
    if step < 0:
        raise ValueError(f"`{verb}` takes a `step` >= 0, but got {step}.")
    return int(step)


def _manager(ocp: Any, directory: str, *, create: bool, **options: Any) -> Any:
    options = ocp.CheckpointManagerOptions(create=create, **options)
    return ocp.CheckpointManager(
        directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
    )


def _steps(ocp: Any, directory: str) -> list[int]:
    """The finalised steps in `directory` (a save in progress is not one), ascending."""
    if "://" not in directory and not os.path.isdir(directory):
        return []
    return sorted(ocp.utils.checkpoint_steps(directory))


def _names(verb: str, flat: Flat) -> dict[str, int]:
    """Each array leaf's name in the checkpoint (its dotted path) -> its index in `flat`."""
    names: dict[str, list[int]] = {}
    for i in flat.array_indices:
        names.setdefault(dotted_path(flat.paths[i]) or "<root>", []).append(i)
    clashes = [
        (name, ", ".join(pathstr(flat.paths[i]) for i in indices))
        for name, indices in names.items()
        if len(indices) > 1
    ]
    if clashes:
        raise ValueError(
            leaf_error(
                f"`{verb}` names each array leaf by its dotted path, but these leaves share a "
                "name:",
                clashes,
                "Give them distinct keys (e.g. do not mix the dict keys `0` and `'0'`, or a "
                "dict key containing a dot with an attribute path).",
            )
        )
    return {name: indices[0] for name, indices in names.items()}


# ----------------------------------------------------------------------------- save


class AsyncSave:
    """A save started by `filter_save`; `wait()` blocks until it is on disk.

    With `filter_save(..., wait=True)` (the default) the save is already finished when
    this is returned. Every process must call `wait()` (it ends with a barrier across
    processes). Saves still running when Python exits are waited for at exit.
    """

    def __init__(self, manager: Any, directory: str, step: int):
        self.directory, self.step = directory, step
        self._manager: Any = manager
        self._lock = threading.Lock()

    def wait(self) -> None:
        """Blocks until the checkpoint is written and committed (a no-op once it is)."""
        with self._lock:
            if self._manager is None:
                return
            manager, self._manager = self._manager, None
        try:
            manager.wait_until_finished()
        finally:
            manager.close()
            if _PENDING.get(self.directory) is self:
                del _PENDING[self.directory]

    def done(self) -> bool:
        """Whether the write has finished (without waiting, and without committing)."""
        manager = self._manager
        return manager is None or not manager.is_saving_in_progress()

    def __repr__(self) -> str:
        state = "done" if self.done() else "in progress"
        return f"AsyncSave(directory={self.directory!r}, step={self.step}, {state})"


# directory -> its save still being written; a new save to a directory waits for it.
_PENDING: dict[str, AsyncSave] = {}
_AT_EXIT: list[bool] = []


def _wait_all() -> None:
    for pending in list(_PENDING.values()):
        pending.wait()


def _wait_at_exit() -> None:
    """Waits for running saves at exit. Registered on the first save, hence after
    `jax.distributed.initialize` registered its shutdown: exit handlers run last-in
    first-out, so the saves (which end with a barrier) finish before the shutdown."""
    if not _AT_EXIT:
        atexit.register(_wait_all)
        _AT_EXIT.append(True)


def filter_save(
    directory: str | os.PathLike,
    step: int,
    tree: PyTree,
    *,
    max_to_keep: int | None = None,
    wait: bool = True,
) -> AsyncSave:
    """Saves the array leaves of `tree` as checkpoint `step` in `directory`, sharded.

    Writes `directory/<step>` with `orbax-checkpoint`: each array leaf under its dotted
    path (`layers.0.weight`), with its shape, dtype and sharding; each process writes
    only its own devices' shards. Non-array leaves are not saved (`filter_restore` takes
    them from its `like` tree). PRNG key arrays are saved as their key data.

    With several processes, call it on every process with the same `tree` (global arrays
    spanning all of them) and the same `directory`, on a filesystem every process sees.

    **Arguments:**

    - `directory`: the checkpoint directory (a `str` or `os.PathLike`; also a URL such as
        `gs://bucket/run` that orbax supports). Created if missing.
    - `step`: an int >= 0, not already saved in `directory`.
    - `tree`: any PyTree, e.g. a model, or `(model, opt_state)`.
    - `max_to_keep`: keep only this many checkpoints in `directory`, deleting the oldest
        saved after this one is written. `None` keeps all.
    - `wait`: `True` returns once the checkpoint is on disk. `False` returns as soon as
        the arrays are copied off the devices and writes in the background: call
        `.wait()` on the result (on every process) before relying on the checkpoint. A
        later `filter_save` to the same directory first waits for the one before, and
        Python waits for every running save at exit.

    **Returns:**

    An `AsyncSave` with `.wait()`, `.done()`, `.directory` and `.step`.

    **Raises:**

    - `ImportError`: if `orbax-checkpoint` is not installed.
    - `TypeError`: if `directory` or `step` has the wrong type, or a leaf is traced
        (`filter_save` called inside `jit`, `vmap` or `grad`).
    - `ValueError`: if `step` is already saved in `directory`, or two leaves share a
        dotted path.

    !!! Example

        ```python
        import tempfile

        directory = tempfile.mkdtemp()
        mesh = jax.make_mesh((jax.device_count(),), ("data",))
        model = eqx.nn.MLP(64, 64, 256, 2, key=jax.random.key(0))
        model = eqxshard.filter_shard(model, mesh, eqxshard.fsdp("data"))
        eqxshard.filter_save(directory, 100, model)
        assert eqxshard.latest_step(directory) == 100
        ```
    """
    verb = "filter_save"
    ocp = _orbax(verb)
    directory, step = _directory(directory, verb), _step(step, verb)
    if max_to_keep is not None and (isinstance(max_to_keep, bool) or max_to_keep < 1):
        raise ValueError(f"`filter_save` takes `max_to_keep` >= 1 or None, not {max_to_keep!r}.")
    flat = Flat(tree)
    traced = [
        pathstr(flat.paths[i]) for i in flat.array_indices if _compat.is_tracer(flat.leaves[i])
    ]
    if traced:
        raise TypeError(
            leaf_error(
                "`filter_save` cannot save traced leaves (it was called inside `jit`, `vmap`, "
                "`grad` or `eval_shape`):",
                [(p,) for p in traced],
                "Call `filter_save` outside the transformation, on its outputs.",
            )
        )
    names = _names(verb, flat)
    if not names:
        raise ValueError(
            "`filter_save` found no array leaves in `tree`, so there is nothing to save "
            "(non-array leaves are never saved: `filter_restore` takes them from `like`)."
        )
    pending = _PENDING.get(directory)
    if pending is not None:
        pending.wait()
    if step in _steps(ocp, directory):
        raise ValueError(
            f"`filter_save` found step {step} already saved in {directory}. Save under a new "
            "step, or delete that step's directory first."
        )
    arrays = {}
    for name, i in names.items():
        leaf = flat.leaves[i]
        arrays[name] = jax.random.key_data(leaf) if _compat.is_prng_key(leaf) else leaf
    manager = _manager(
        ocp, directory, create=True, max_to_keep=max_to_keep, enable_async_checkpointing=True
    )
    handle = AsyncSave(manager, directory, step)
    try:
        # `force`: orbax skips (returning False) a step below its latest one; a step asked
        # for is a step saved.
        manager.save(step, args=ocp.args.StandardSave(arrays), force=True)
    except BaseException:
        handle.wait()
        raise
    _PENDING[directory] = handle
    _wait_at_exit()
    if wait:
        handle.wait()
    return handle


# ----------------------------------------------------------------------------- restore


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest step saved in `directory` by `filter_save`, or `None` if there is none.

    A save still being written (`filter_save(..., wait=False)`) does not count until it
    has finished. A missing directory has no steps.

    **Raises:**

    - `ImportError`: if `orbax-checkpoint` is not installed.
    - `TypeError`: if `directory` is not a `str` or `os.PathLike`.
    """
    ocp = _orbax("latest_step")
    steps = _steps(ocp, _directory(directory, "latest_step"))
    return steps[-1] if steps else None
