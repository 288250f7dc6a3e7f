"""Sharded checkpoints through `orbax-checkpoint`: `filter_save` and `latest_step`.

Only the array leaves are saved, each with its sharding, keyed by its dotted path
(`layers.0.weight`, as `describe` prints it and `path_rules` matches it). Non-array
leaves (activation functions, static fields) are never written: `filter_restore` takes
them from a `like` tree, e.g. `eqx.filter_eval_shape` of the model's constructor, and
reads each array straight into the layout it is asked for, which may be another mesh
or another number of processes than at save time. Every process reads only its own
devices' shards; no whole array is gathered on a host.

`orbax-checkpoint` is an optional dependency (`pip install eqxshard[checkpoint]`),
imported on first use only. `filter_restore` is in `_restore.py`, `AsyncSave` (waiting for
a save, at exit too, and cleaning up after a failed one) in `_async_save.py`.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from . import _compat
from ._async_save import (
    _PENDING,
    AsyncSave as AsyncSave,
    _capture_write_errors,
    _release_waiting_threads,
    _remove_partial,
    _wait_at_exit,
)
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


def _max_to_keep(max_to_keep: Any) -> int | None:
    if max_to_keep is None:
        return None
    if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int | np.integer):
        raise TypeError(
            "`filter_save` takes `max_to_keep` as an int >= 1 or None, but got "
            f"{max_to_keep!r} ({type(max_to_keep).__name__}). Pass e.g. `max_to_keep=3`."
        )
    if max_to_keep < 1:
        raise ValueError(
            f"`filter_save` takes `max_to_keep` >= 1 or None, but got {max_to_keep}. Pass "
            "`None` to keep every checkpoint."
        )
    return int(max_to_keep)


def _writable(directory: str) -> None:
    """Raises if `directory`, or a folder above it, is an existing non-directory."""
    if "://" in directory:
        return
    path = directory
    while True:
        if os.path.exists(path):
            if not os.path.isdir(path):
                what = "is" if path == directory else f"is inside {path}, which is"
                raise NotADirectoryError(
                    f"`filter_save` cannot write to `directory` {directory}: it {what} a file, "
                    "not a directory. Pass a directory path (it is created if missing)."
                )
            return
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def _manager(ocp: Any, directory: str, *, create: bool, **options: Any) -> Any:
    options = ocp.CheckpointManagerOptions(create=create, **options)
    return ocp.CheckpointManager(
        directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
    )


def _all_steps(ocp: Any, directory: str) -> list[int]:
    """The finalised steps in `directory` (a save in progress is not one), ascending,
    whether complete or damaged."""
    if "://" not in directory and not os.path.isdir(directory):
        return []
    return sorted(ocp.utils.checkpoint_steps(directory))


def damage(directory: str, step: int) -> str | None:
    """What is missing or unreadable in step `step` of `directory`, or `None` if its
    metadata is complete (array data is only read by `filter_restore`). URLs are not
    checked."""
    if "://" in directory:
        return None
    step_dir = os.path.join(directory, str(step))
    if not os.path.isfile(os.path.join(step_dir, "_CHECKPOINT_METADATA")):
        return f"{step_dir}/_CHECKPOINT_METADATA is missing"
    metadata = os.path.join(step_dir, "default", "_METADATA")
    if not os.path.isfile(metadata):
        return f"{metadata} is missing"
    try:
        with open(metadata) as f:
            tree = json.load(f)["tree_metadata"]
        if not isinstance(tree, dict):
            raise TypeError(type(tree).__name__)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{metadata} is unreadable ({type(e).__name__}: {e})"
    return None


# (directory, step) of the damaged steps already warned about, so that each is said once.
_WARNED: set[tuple[str, int]] = set()


def _steps(ocp: Any, directory: str, *, warn: bool = True) -> list[int]:
    """The complete steps in `directory`, ascending. A damaged one (an interrupted copy,
    lost metadata) is skipped, with a warning the first time it is seen (with `warn`)."""
    steps = []
    for step in _all_steps(ocp, directory):
        problem = damage(directory, step)
        if problem is None:
            steps.append(step)
        elif warn and (directory, step) not in _WARNED:
            _WARNED.add((directory, step))
            warnings.warn(
                f"eqxshard skips step {step} in {directory}: it is damaged ({problem}). "
                "Delete that step's directory to silence this.",
                stacklevel=3,
            )
    return steps


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
    - `max_to_keep`: an int >= 1: keep only this many checkpoints in `directory`,
        deleting the oldest saved after this one is written.
    - `max_to_keep=None` keeps all.
    - `wait`: `True` returns once the checkpoint is on disk. `False` returns as soon as
        the arrays are copied off the devices and writes in the background: call
        `.wait()` on the result (on every process) before relying on the checkpoint. A
        later `filter_save` to the same directory first waits for the one before. When
        the program ends normally (also by `sys.exit(0)`), Python finishes every running
        save before it exits; one that fails then is reported on stderr as not on disk.
        A process ended by an error in a run joined by `initialize` does not wait.

    Everything is checked before anything is written. A save that fails leaves no
    partial step behind (orbax's temporary directory is removed).

    **Returns:**

    An `AsyncSave` with `.wait()`, `.done()`, `.directory` and `.step`.

    **Raises:**

    - `ImportError`: if `orbax-checkpoint` is not installed.
    - `TypeError`: if `directory`, `step`, `max_to_keep` or `wait` has the wrong type,
        or a leaf is traced (`filter_save` called inside `jit`, `vmap` or `grad`).
    - `ValueError`: if `step` < 0, `max_to_keep` < 1, `step` is already saved in
        `directory`, two leaves share a dotted path, `tree` has no array leaf, or a leaf
        has a zero-size dimension.
    - `NotADirectoryError`: if `directory` or a folder above it is a file.
    - Any error of the write itself (e.g. `OSError` on a full disk).

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
    max_to_keep = _max_to_keep(max_to_keep)
    if not isinstance(wait, bool):
        raise TypeError(f"`filter_save` takes `wait` as a bool, but got {type(wait).__name__}.")
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
    empty = [
        (pathstr(flat.paths[i]), f"shape {tuple(flat.leaves[i].shape)}")
        for i in names.values()
        if 0 in flat.leaves[i].shape
    ]
    if empty:
        raise ValueError(
            leaf_error(
                "`filter_save` cannot save arrays with a zero-size dimension (orbax cannot "
                "write them), and these leaves of `tree` have one:",
                empty,
                "Make them non-array leaves (e.g. `None`, or a static field), or give them "
                "at least one element.",
            )
        )
    _writable(directory)
    pending = _PENDING.get(directory)
    if pending is not None:
        pending.wait()
    if step in _all_steps(ocp, directory):
        state = "" if damage(directory, step) is None else " (damaged)"
        raise ValueError(
            f"`filter_save` found step {step} already saved{state} in {directory}. Save under "
            "a new `step`, or delete that step's directory first."
        )
    arrays = {}
    for name, i in names.items():
        leaf = flat.leaves[i]
        arrays[name] = jax.random.key_data(leaf) if _compat.is_prng_key(leaf) else leaf
    manager = _manager(
        ocp, directory, create=True, max_to_keep=max_to_keep, enable_async_checkpointing=True
    )
    _capture_write_errors(manager)
    handle = AsyncSave(manager, directory, step)
    _wait_at_exit()
    try:
        # `force`: orbax skips (returning False) a step below its latest one; a step asked
        # for is a step saved.
        manager.save(step, args=ocp.args.StandardSave(arrays), force=True)
    except BaseException:
        _release_waiting_threads()
        try:
            handle.wait()
        except BaseException:
            pass  # the error of `save` is the one to raise
        _remove_partial(directory, step)
        raise
    _PENDING[directory] = handle
    if wait:
        handle.wait()
    return handle


# ----------------------------------------------------------------------------- restore


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest step saved in `directory` by `filter_save`, or `None` if there is none.

    A save still being written (`filter_save(..., wait=False)`) does not count until it
    has finished. A missing directory has no steps. A damaged step (its metadata missing
    or unreadable, e.g. an interrupted copy) does not count either: it is skipped with a
    warning, once per step and process.

    **Raises:**

    - `ImportError`: if `orbax-checkpoint` is not installed.
    - `TypeError`: if `directory` is not a `str` or `os.PathLike`.
    """
    ocp = _orbax("latest_step")
    steps = _steps(ocp, _directory(directory, "latest_step"))
    return steps[-1] if steps else None
