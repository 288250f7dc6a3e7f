"""Bad inputs to `filter_save`, `filter_restore` and `latest_step`.

Damaged checkpoints are built at call time in a temporary directory of their own, which
the call removes again.
"""

# Every case passes a bad argument on purpose, to check the error it raises: what a type
# checker says about those arguments is the point of this file, not a mistake in it.
# pyright: reportArgumentType=false, reportCallIssue=false

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import eqxshard

from . import Case

_tree = {"w": jnp.arange(4.0), "b": jnp.ones((2, 3))}
_like = {
    "w": jax.ShapeDtypeStruct((4,), jnp.float32),
    "b": jax.ShapeDtypeStruct((2, 3), jnp.float32),
}
_device = jax.devices()[0]


def _in_temp(call: Callable[[str], Any], saved: tuple[int, ...] = ()) -> Callable[[], Any]:
    """`call(directory)` on a fresh temporary directory holding steps `saved`, then
    removed."""

    def run() -> Any:
        directory = tempfile.mkdtemp(prefix="eqxshard-catalogue-")
        try:
            for step in saved:
                eqxshard.filter_save(directory, step, _tree)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a skipped damaged step says so
                return call(directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    return run


def _damaged(how: str, step: int = 2) -> Callable[[str], Any]:
    """Damages step `step` of the directory, then restores it."""

    def call(directory: str) -> Any:
        step_dir = os.path.join(directory, str(step))
        metadata = os.path.join(step_dir, "default", "_METADATA")
        if how == "no metadata":
            os.remove(metadata)
        elif how == "garbage metadata":
            with open(metadata, "w") as f:
                f.write("{not json")
        elif how == "no tree":
            with open(metadata, "w") as f:
                f.write('{"use_ocdbt": true}')
        elif how == "empty":
            shutil.rmtree(step_dir)
            os.mkdir(step_dir)
        elif how == "truncated":
            for root, _, files in os.walk(step_dir):
                if os.path.basename(root) == "d":
                    for name in files:
                        with open(os.path.join(root, name), "r+b") as f:
                            f.truncate(3)
        return eqxshard.filter_restore(directory, _like, _device, step=step)

    return call


def _into_file(directory: str) -> Any:
    path = os.path.join(directory, "a-file")
    open(path, "w").close()
    return eqxshard.filter_save(path, 0, _tree)


def _latest_of_file(directory: str) -> Any:
    path = os.path.join(directory, "a-file")
    open(path, "w").close()
    return eqxshard.latest_step(path)


def _under_file(directory: str) -> Any:
    path = os.path.join(directory, "a-file")
    open(path, "w").close()
    return eqxshard.filter_save(os.path.join(path, "run"), 0, _tree)


_STEP_IN = r"step 2 in .*eqxshard-catalogue-"


CASES: list[Case] = [
    # filter_save: arguments
    Case(
        "filter_save/directory-int",
        lambda: eqxshard.filter_save(3, 0, _tree),
        TypeError,
        "`directory`",
    ),
    Case(
        "filter_save/step-str",
        _in_temp(lambda d: eqxshard.filter_save(d, "1", _tree)),
        TypeError,
        "`step`",
    ),
    Case(
        "filter_save/step-float",
        _in_temp(lambda d: eqxshard.filter_save(d, 1.0, _tree)),
        TypeError,
        "`step`",
    ),
    Case(
        "filter_save/step-negative",
        _in_temp(lambda d: eqxshard.filter_save(d, -1, _tree)),
        ValueError,
        "`step` >= 0",
    ),
    Case(
        "filter_save/max_to_keep-float",
        _in_temp(lambda d: eqxshard.filter_save(d, 0, _tree, max_to_keep=1.5)),
        TypeError,
        "`max_to_keep`",
    ),
    Case(
        "filter_save/max_to_keep-str",
        _in_temp(lambda d: eqxshard.filter_save(d, 0, _tree, max_to_keep="3")),
        TypeError,
        "`max_to_keep`",
    ),
    Case(
        "filter_save/max_to_keep-zero",
        _in_temp(lambda d: eqxshard.filter_save(d, 0, _tree, max_to_keep=0)),
        ValueError,
        "`max_to_keep` >= 1",
    ),
    Case(
        "filter_save/wait-str",
        _in_temp(lambda d: eqxshard.filter_save(d, 0, _tree, wait="no")),
        TypeError,
        "`wait`",
    ),
    # filter_save: trees and places
    Case(
        "filter_save/zero-size-leaf",
        _in_temp(lambda d: eqxshard.filter_save(d, 0, {"e": jnp.zeros((0, 3))})),
        ValueError,
        r"zero-size(.|\n)*\n  e",
    ),
    Case(
        "filter_save/no-array-leaves",
        _in_temp(lambda d: eqxshard.filter_save(d, 0, {"a": "static"})),
        ValueError,
        "no array leaves in `tree`",
    ),
    Case(
        "filter_save/name-clash",
        _in_temp(
            lambda d: eqxshard.filter_save(d, 0, {"a.b": jnp.ones(1), "a": {"b": jnp.ones(1)}})
        ),
        ValueError,
        r"\['a'\]\['b'\], \['a\.b'\]",
    ),
    Case(
        "filter_save/step-exists",
        _in_temp(lambda d: eqxshard.filter_save(d, 1, _tree), saved=(1,)),
        ValueError,
        r"step 1 already saved in .*eqxshard-catalogue-",
    ),
    Case(
        "filter_save/directory-is-a-file",
        _in_temp(_into_file),
        NotADirectoryError,
        r"`directory` .*a-file: it is a file",
    ),
    Case(
        "latest_step/directory-is-a-file",
        _in_temp(_latest_of_file),
        NotADirectoryError,
        r"`latest_step` got `directory` .*a-file: it is a file",
    ),
    Case(
        "filter_save/directory-under-a-file",
        _in_temp(_under_file),
        NotADirectoryError,
        r"`directory` .*a-file/run: it is inside",
    ),
    # filter_restore / latest_step: arguments and missing things
    Case(
        "latest_step/directory-none", lambda: eqxshard.latest_step(None), TypeError, "`directory`"
    ),
    Case(
        "filter_restore/directory-list",
        lambda: eqxshard.filter_restore(["x"], _like, _device),
        TypeError,
        "`directory`",
    ),
    Case(
        "filter_restore/missing-directory",
        _in_temp(lambda d: eqxshard.filter_restore(os.path.join(d, "nope"), _like, _device)),
        FileNotFoundError,
        r"no checkpoint in .*eqxshard-catalogue-.*nope",
    ),
    Case(
        "filter_restore/missing-step",
        _in_temp(lambda d: eqxshard.filter_restore(d, _like, _device, step=7), saved=(1,)),
        FileNotFoundError,
        r"no step 7 in .*holds steps \[1\]",
    ),
    Case(
        "filter_restore/step-negative",
        _in_temp(lambda d: eqxshard.filter_restore(d, _like, _device, step=-1), saved=(1,)),
        ValueError,
        "`step` >= 0",
    ),
    Case(
        "filter_restore/mismatched-tree",
        _in_temp(
            lambda d: eqxshard.filter_restore(d, {"w": _like["w"], "c": _like["b"]}, _device),
            saved=(1,),
        ),
        ValueError,
        r"step 1 in .*does not match `like`(.|\n)*c  in `like`",
    ),
    Case(
        "filter_restore/mismatched-shape",
        _in_temp(
            lambda d: eqxshard.filter_restore(
                d, {**_like, "w": jax.ShapeDtypeStruct((5,), jnp.float32)}, _device
            ),
            saved=(1,),
        ),
        ValueError,
        r"w  in `like` as \(5,\) float32",
    ),
    Case(
        "filter_restore/no-sharding",
        _in_temp(lambda d: eqxshard.filter_restore(d, _like), saved=(1,)),
        ValueError,
        r"no sharding to read these leaves into(.|\n)*\n  w",
    ),
    # filter_restore: damaged steps
    Case(
        "filter_restore/damaged-no-metadata",
        _in_temp(_damaged("no metadata"), saved=(1, 2)),
        ValueError,
        _STEP_IN + r".*_METADATA is missing.*pass `step=1`",
    ),
    Case(
        "filter_restore/damaged-garbage-metadata",
        _in_temp(_damaged("garbage metadata"), saved=(1, 2)),
        ValueError,
        _STEP_IN + r".*_METADATA is unreadable.*pass `step=1`",
    ),
    Case(
        "filter_restore/damaged-metadata-without-tree",
        _in_temp(_damaged("no tree"), saved=(1, 2)),
        ValueError,
        _STEP_IN + r".*_METADATA is unreadable \(KeyError",
    ),
    Case(
        "filter_restore/damaged-empty-step",
        _in_temp(_damaged("empty"), saved=(1, 2)),
        ValueError,
        _STEP_IN + r".*_CHECKPOINT_METADATA is missing",
    ),
    Case(
        "filter_restore/damaged-truncated-data",
        _in_temp(_damaged("truncated"), saved=(1, 2)),
        ValueError,
        _STEP_IN + r".*unreadable.*pass `step=1`",
    ),
    Case(
        "filter_restore/damaged-only-step",
        _in_temp(_damaged("no metadata", step=1), saved=(1,)),
        ValueError,
        r"step 1 in .*no good step before it",
    ),
    Case(
        "filter_save/directory-empty",
        lambda: eqxshard.filter_save("", 0, _tree),
        ValueError,
        r"`filter_save` got an empty `directory`",
    ),
    Case(
        "filter_restore/directory-empty",
        lambda: eqxshard.filter_restore("", _like),
        ValueError,
        r"`filter_restore` got an empty `directory`",
    ),
]
