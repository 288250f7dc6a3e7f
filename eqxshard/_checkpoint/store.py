"""The orbax side of checkpoints: the `orbax` import, checked directories and steps,
the checkpoint manager, the steps on disk and whether a step is complete, and the names
leaves are saved under. Shared by `filter_save`, `latest_step` and `filter_restore`.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import jax
import numpy as np

from .._pipeline.stacked.stacked import Stacked
from .._tree import Flat, dotted_path, leaf_error
from .loops import drain_orbax_loops

# (directory, step) of the damaged steps already warned about, so that each is said once.
_WARNED: set[tuple[str, int]] = set()


def import_orbax(verb: str) -> Any:
    """`orbax.checkpoint`, imported on first use (orbax's event loops then drained before
    they close, see `loops.py`); an `ImportError` naming `verb` if it is not installed."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            f"`{verb}` needs the `orbax-checkpoint` package, which is not installed. "
            "Install it with `pip install eqxshard[checkpoint]`."
        ) from e
    drain_orbax_loops()
    return ocp


def checked_directory(directory: Any, verb: str) -> str:
    """`directory` (a `str` or `os.PathLike`, not empty) as the absolute path orbax wants;
    URLs (`gs://...`) as they are."""
    if not isinstance(directory, str | os.PathLike):
        raise TypeError(
            f"`{verb}` takes a `directory` as a `str` or `os.PathLike`, but got "
            f"{type(directory).__name__}."
        )
    directory = os.fspath(directory)
    if not directory:
        raise ValueError(
            f'`{verb}` got an empty `directory`. Pass the checkpoint directory\'s path ("." '
            "for the current directory)."
        )
    return directory if "://" in directory else os.path.abspath(directory)


def checked_step(step: Any, verb: str) -> int:
    """`step` as an int >= 0 (a NumPy integer too; not a bool)."""
    if isinstance(step, bool) or not isinstance(step, int | np.integer):
        raise TypeError(f"`{verb}` takes an int `step`, but got {type(step).__name__}.")
    if step < 0:
        raise ValueError(f"`{verb}` takes a `step` >= 0, but got {step}.")
    return int(step)


def checked_max_to_keep(max_to_keep: Any) -> int | None:
    """`filter_save`'s `max_to_keep` as an int >= 1, or `None` (keep every step)."""
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


def check_writable(directory: str) -> None:
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


def open_manager(ocp: Any, directory: str, *, create: bool, **options: Any) -> Any:
    """orbax's `CheckpointManager` of `directory` with one item (`default`), written and
    read by the standard handler; `options` are its `CheckpointManagerOptions`. The
    caller closes it."""
    options = ocp.CheckpointManagerOptions(create=create, **options)
    return ocp.CheckpointManager(
        directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
    )


def steps_on_disk(ocp: Any, directory: str) -> list[int]:
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


def complete_steps(ocp: Any, directory: str, *, warn: bool = True) -> list[int]:
    """The complete steps in `directory`, ascending. A damaged one (an interrupted copy,
    lost metadata) is skipped, with a warning the first time it is seen (with `warn`)."""
    steps = []
    for step in steps_on_disk(ocp, directory):
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


def leaf_names(verb: str, flat: Flat, tree: Any = None) -> dict[str, int]:
    """Each array leaf's name in the checkpoint (its dotted path) -> its index in `flat`.

    The leaves of a `Stacked` of `tree` stored stage-major carry that order in their
    names (`blocks.stage_major_4x2.weight`: 4 stages x `repeats=2`), so that a restore
    into a stack stored in another order fails, naming them, instead of loading the
    layers in the wrong order."""
    orders = stored_orders(tree)
    names: dict[str, list[int]] = {}
    for i in flat.array_indices:
        names.setdefault(_name(flat.paths[i], orders), []).append(i)
    # The leaves that share a dotted name are told apart in `keystr`'s form (`['a.b']`,
    # `['a']['b']`): the one place eqxshard prints a path not dotted.
    clashes = [
        (name, ", ".join(jax.tree_util.keystr(flat.paths[i]) for i in indices))
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


def stored_orders(tree: Any) -> list[tuple[tuple, str]]:
    """The key path of each `Stacked` of `tree` stored stage-major, and its order's tag."""
    found: list[tuple[tuple, str]] = []

    def visit(path: Any, x: Any) -> None:
        if isinstance(x, Stacked) and x.stages is not None:
            found.append((tuple(path), f"stage_major_{x.stages}x{x.repeats}"))

    if tree is not None:
        is_stack = lambda x: isinstance(x, Stacked)  # noqa: E731
        jax.tree_util.tree_map_with_path(visit, tree, is_leaf=is_stack)
    return found


def _name(path: Any, orders: list[tuple[tuple, str]]) -> str:
    for prefix, tag in orders:
        if tuple(path[: len(prefix)]) == prefix:
            parts = [dotted_path(prefix), tag, dotted_path(path[len(prefix) :])]
            return ".".join(part for part in parts if part)
    return dotted_path(path) or "<root>"


def read_part(ocp: Any, directory: str, step: int, abstract: dict[str, Any]) -> dict[str, Any]:
    """Reads only the leaves of `abstract` (a part of the saved tree), each straight into
    its sharding and dtype.

    `StandardRestore` wants the whole saved tree, so this reads the step's one item
    (`default`, where `_manager`'s single handler writes it) with orbax's PyTree handler
    and `partial_restore=True`: the leaves left out are never read.
    """
    path = f"{directory.rstrip('/')}/{step}/default"
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    try:
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        args = ocp.args.PyTreeRestore(abstract, restore_args=restore_args, partial_restore=True)
        return checkpointer.restore(path, args=args)
    finally:
        checkpointer.close()
