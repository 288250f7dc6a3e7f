"""Sharded checkpoints through `orbax-checkpoint`: `filter_save` and `latest_step`.

Only the array leaves are saved, each with its sharding, keyed by its dotted path
(`layers.0.weight`, as `describe` prints it and `path_rules` matches it). Non-array
leaves (activation functions, static fields) are never written: `filter_restore` takes
them from a `like` tree, e.g. `eqx.filter_eval_shape` of the model's constructor, and
reads each array straight into the layout it is asked for, which may be another mesh
or another number of processes than at save time. Every process reads only its own
devices' shards; no whole array is gathered on a host.

`orbax-checkpoint` is an optional dependency (`pip install eqxshard[checkpoint]`),
imported on first use only. `filter_restore` is in `restore.py`, `AsyncSave` (waiting for
a save, at exit too, and cleaning up after a failed one) in `async_save.py`, the orbax
side (arguments checked, orbax's manager, the steps on disk) in `store.py`.
"""

from __future__ import annotations

import os

import jax
from jaxtyping import PyTree

from .. import _compat
from .._tree import Flat, leaf_error, pathstr
from .async_save import (
    AsyncSave,
    capture_write_errors,
    finish_running_save,
    release_waiting_threads,
    remove_leftovers,
    remove_partial,
    track_running_save,
    wait_at_exit,
)
from .store import (
    check_writable,
    checked_directory,
    checked_max_to_keep,
    checked_step,
    complete_steps,
    damage,
    import_orbax,
    leaf_names,
    open_manager,
    steps_on_disk,
)

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
        A one-process run does so also when it ends by `sys.exit(n)` or an uncaught
        exception; a process ended by an error in a run joined by `initialize` does not
        wait, and one killed or ended by `os._exit` cannot.

    Everything is checked before anything is written. A save that fails leaves no
    partial step behind (orbax's temporary directory is removed). The temporary
    directories of killed saves of earlier steps are removed.

    **Returns:**

    An `AsyncSave` with `.wait()`, `.done()`, `.directory` and `.step`.

    **Raises:**

    - `ImportError`: if `orbax-checkpoint` is not installed.
    - `TypeError`: if `directory`, `step`, `max_to_keep` or `wait` has the wrong type,
        or a leaf is traced (`filter_save` called inside `jit`, `vmap` or `grad`).
    - `ValueError`: if `directory` is empty, `step` < 0, `max_to_keep` < 1, `step` is
        already saved in `directory`, two leaves share a dotted path, `tree` has no array
        leaf, or a leaf has a zero-size dimension.
    - `NotADirectoryError`: if `directory` or a folder above it is a file.
    - `OSError` (e.g. `PermissionError`): if `directory` cannot be created.
    - `OSError`: if the step is not complete on disk once committed (e.g. another process
        saved the same step into `directory` at the same time).
    - Any error of the write itself (e.g. `OSError` on a full disk).

    !!! Example

        ```python
        import tempfile

        directory = tempfile.mkdtemp()
        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
        model = eqx.nn.MLP(64, 64, 256, 2, key=jax.random.key(0))
        model = eqxshard.filter_shard(model, mesh, eqxshard.fsdp("data"))
        eqxshard.filter_save(directory, 100, model)
        assert eqxshard.latest_step(directory) == 100
        ```
    """
    verb = "filter_save"
    ocp = import_orbax(verb)
    directory, step = checked_directory(directory, verb), checked_step(step, verb)
    max_to_keep = checked_max_to_keep(max_to_keep)
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
    names = leaf_names(verb, flat, tree)
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
    check_writable(directory)
    finish_running_save(directory)
    if step in steps_on_disk(ocp, directory):
        state = "" if damage(directory, step) is None else " (damaged)"
        raise ValueError(
            f"`filter_save` found step {step} already saved{state} in {directory}. Save under "
            "a new `step`, or delete that step's directory first."
        )
    arrays = {}
    for name, i in names.items():
        leaf = flat.leaves[i]
        arrays[name] = jax.random.key_data(leaf) if _compat.is_prng_key(leaf) else leaf
    if jax.process_index() == 0:
        remove_leftovers(directory, step)
    if "://" not in directory:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise type(e)(
                e.errno,
                f"`filter_save` cannot create `directory` {directory}: {e.strerror}. Pass a "
                "directory this process can write to.",
            ) from e
    manager = open_manager(
        ocp, directory, create=True, max_to_keep=max_to_keep, enable_async_checkpointing=True
    )
    capture_write_errors(manager)
    handle = AsyncSave(manager, directory, step)
    wait_at_exit()
    try:
        # `force`: orbax skips (returning False) a step below its latest one; a step asked
        # for is a step saved.
        manager.save(step, args=ocp.args.StandardSave(arrays), force=True)
    except BaseException:
        release_waiting_threads()
        try:
            handle.wait()
        except BaseException:
            pass  # the error of `save` is the one to raise
        remove_partial(directory, step)
        raise
    track_running_save(handle)
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
    - `ValueError`: if `directory` is empty.
    - `NotADirectoryError`: if `directory` is a file.
    """
    ocp = import_orbax("latest_step")
    path = checked_directory(directory, "latest_step")
    if os.path.isfile(path):  # a mistyped path must not read as "start from scratch"
        raise NotADirectoryError(
            f"`latest_step` got `directory` {path}: it is a file, not a checkpoint "
            "directory. Pass the directory `filter_save` writes to."
        )
    steps = complete_steps(ocp, path)
    return steps[-1] if steps else None
