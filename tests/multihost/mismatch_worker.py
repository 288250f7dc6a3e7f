"""One process of `test_mismatch_multihost.py`: processes that pass different trees.

    python mismatch_worker.py PORT PROCESS_ID NUM_PROCESSES

Each scenario gives the two processes trees that differ (in structure, in which leaves
are arrays, in dtypes, shapes or arguments) and checks that the call raises on *this*
process with a message showing what every process passed, instead of aborting in a
collective whose size differs between processes (gloo's "collective mismatch"). The
last scenario checks that both processes are still in step afterwards.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from worker_common import check, join, raises, run_scenarios

import eqxshard

SCENARIOS: dict[str, Callable[[int], None]] = {}


def scenario(fn: Callable[[int], None]) -> Callable[[int], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


def mesh8(kind: AxisType = AxisType.Explicit) -> Any:
    return jax.make_mesh((8,), ("data",), axis_types=(kind,))


X = np.arange(8, dtype=np.float32)


@scenario
def extra_leaf_on_one_process(process: int) -> None:
    tree = {"a": X} if process == 0 else {"a": X, "b": X}
    raises(
        lambda: eqxshard.filter_shard(tree, mesh8(), P("data")),
        [
            "`filter_shard` was given different tree structures on different processes",
            "\n  b",
            "process 0: no such leaf",
            "process 1: float32 (8,)",
        ],
        absent=("\n  a",),
    )


@scenario
def numpy_scalar_against_python_float(process: int) -> None:
    tree = {"w": X, "s": np.float32(0.5) if process == 0 else 0.5}
    raises(
        lambda: eqxshard.filter_shard(tree, mesh8()),
        ["\n  s", "process 0: float32 ()", "process 1: float (not an array)"],
        absent=("\n  w",),
    )


@scenario
def no_array_at_all_on_one_process(process: int) -> None:
    """Process 0 has nothing to place, yet takes part: process 1's leaf differs."""
    tree = {"s": 0.5 if process == 0 else np.float32(0.5)}
    raises(
        lambda: eqxshard.filter_replicate(tree, mesh8()),
        ["`filter_replicate`", "\n  s", "process 0: float (not an array)"],
    )


@scenario
def different_dtypes(process: int) -> None:
    tree = {"x": np.zeros(8, np.float32 if process == 0 else np.int32), "ok": X}
    raises(
        lambda: eqxshard.filter_shard(tree, mesh8(AxisType.Auto), P("data")),
        ["different dtypes on different processes", "process 0: float32 (8,)", "int32 (8,)"],
        absent=("\n  ok",),
    )


@scenario
def filter_put_on_a_global_sharding(process: int) -> None:
    sharding = NamedSharding(mesh8(), P("data"))
    tree = [X, X] if process == 0 else [X]
    raises(lambda: eqxshard.filter_put(tree, sharding), ["`filter_put`", "\n  1 ", "no such leaf"])


@scenario
def process_local_parts_of_different_structure(process: int) -> None:
    tree = {"x": X[:4]} if process == 0 else {"x": X[:4], "y": {"z": X[:4]}}
    raises(
        lambda: eqxshard.filter_shard(tree, mesh8(), P("data"), process_local=True),
        ["\n  y.z", "process 0: no such leaf", "process 1: float32 (4,)"],
    )


@scenario
def leaves_placed_on_local_devices_may_differ(process: int) -> None:
    """Only leaves bound for several processes are compared: a leaf each process puts on
    its own device may differ, and a leaf that does so on one process only is named."""
    mine = np.zeros(3 + process, np.float32)  # a per-process array
    tree = {"x": X, "mine": mine}
    target = {"x": mesh8(), "mine": jax.local_devices()[0]}
    out = eqxshard.filter_shard(tree, target)
    check(out["mine"].shape == (3 + process,), "the local leaf was placed as given")
    x = out["x"]
    check(isinstance(x, jax.Array) and not x.is_fully_addressable, "x spans both processes")
    target = {"x": mesh8(), "mine": mesh8() if process == 0 else jax.local_devices()[0]}
    tree = {"x": X, "mine": np.zeros(3, np.float32)}
    raises(
        lambda: eqxshard.filter_shard(tree, target),
        ["\n  mine", "process 0: float32 (3,)", "process 1: an array placed on this process only"],
    )


@scenario
def an_error_on_one_process_only(process: int) -> None:
    """Process 1 names an axis the mesh lacks, so it alone fails to resolve: it still
    takes part in the check, and both raise."""
    spec = P("data") if process == 0 else P("nope")
    message = raises(
        lambda: eqxshard.filter_shard({"x": X}, mesh8(), spec),
        ["failed on some processes only", "process 1:", "'nope'"],
    )
    check("process 0:" not in message, message)


@scenario
def a_callable_spec_failing_on_one_process(process: int) -> None:
    """Every process raises the same `ValueError`, naming process 1's own exception
    (which is its context on process 1)."""

    def spec(path: Any, x: Any) -> P:
        if process == 1:
            raise KeyError("no spec for this leaf")
        return P("data")

    try:
        eqxshard.filter_shard({"x": X}, mesh8(), spec)
    except ValueError as e:
        check("process 1: KeyError: 'no spec for this leaf'" in str(e), str(e))
        check("process 0:" not in str(e), str(e))
        check(isinstance(e.__context__, KeyError) == (process == 1), repr(e.__context__))
    else:
        raise AssertionError("nothing raised")


@scenario
def plans_of_different_shapes(process: int) -> None:
    rows = 8 if process == 0 else 16
    tree = {"w": jax.ShapeDtypeStruct((rows, 2), jnp.float32)}
    # Reading a plan issues no collective: each process plans its own tree (and process 0
    # alone may log one); the verbs that act on a plan compare it across processes.
    plan = eqxshard.filter_shardings(tree, mesh8(), P("data"))
    check(plan["w"].spec == P("data"), repr(plan))
    if process == 0:
        eqxshard.describe(tree, mesh8(), P("data"))

    def make() -> Any:
        return {"w": jnp.zeros((rows, 2))}

    raises(
        lambda: eqxshard.filter_init(make, mesh8(), P("data"))(),
        ["`filter_init`", "\n  w", "process 0: (8, 2)", "process 1: (16, 2)"],
    )


@scenario
def filter_get_of_different_global_trees(process: int) -> None:
    mesh = mesh8()
    placed = eqxshard.filter_shard({"a": X, "b": X * 2}, mesh, P("data"))
    tree = {"a": placed["a"]} if process == 0 else placed
    raises(
        lambda: eqxshard.filter_get(tree),
        [
            "`filter_get` was given different tree structures",
            "\n  b",
            "process 0: no such leaf",
            "process 1: float32 (8,)",
            "nothing was gathered",
        ],
        absent=("\n  a",),
    )
    # Different global arrays under the same path: same structure, other shapes.
    other = eqxshard.filter_shard(np.zeros((16, 2), np.float32), mesh, P("data"))
    tree = {"a": placed["a"] if process == 0 else other}
    raises(
        lambda: eqxshard.filter_get(tree),
        ["`filter_get` was given different shapes", "process 0: (8,)", "process 1: (16, 2)"],
    )
    # A global array on one process where the other has a local one.
    tree = {"a": placed["a"], "b": placed["b"] if process == 0 else np.zeros(3)}
    raises(
        lambda: eqxshard.filter_get(tree),
        ["`filter_get`", "\n  b", "process 0: float32 (8,)", "process 1: an array on this"],
        absent=("\n  a",),
    )


@scenario
def different_check_consistent_flags(process: int) -> None:
    """The flag decides whether the data checksums are exchanged, so it must agree."""
    raises(
        lambda: eqxshard.filter_shard({"x": X}, mesh8(), check_consistent=process == 0),
        [
            "`filter_shard` was called with different `check_consistent`",
            "process 0: True, process 1: False",
        ],
    )


@scenario
def different_verbs_at_the_same_point(process: int) -> None:
    mesh = mesh8()
    placed = eqxshard.filter_shard({"a": X}, mesh, P("data"))
    if process == 0:
        call = lambda: eqxshard.filter_shard({"a": X}, mesh, P("data"))  # noqa: E731
    else:
        call = lambda: eqxshard.filter_get(placed)  # noqa: E731
    raises(
        call,
        ["different eqxshard calls", "process 0: `filter_shard`", "process 1: `filter_get`"],
    )


@scenario
def still_in_step_afterwards(process: int) -> None:
    mesh = mesh8()
    model = eqx.nn.Linear(8, 8, key=jax.random.key(0))
    placed = eqxshard.filter_shard(model, mesh, P("data"))
    back = eqxshard.filter_get(placed)
    check(np.array_equal(back.weight, np.asarray(model.weight)), "weights differ")
    check(not placed.weight.is_fully_addressable, "not a global array")


@scenario
def filter_get_of_global_arrays_on_one_process_only(process: int) -> None:
    """Process 1 fetches a tree holding no array that spans processes, so it takes part
    in no check; process 0, which fetches a global array, waits for it only so long."""
    placed = eqxshard.filter_shard({"a": X}, mesh8(), P("data"))
    if process == 0:
        os.environ["EQXSHARD_SYNC_TIMEOUT"] = "1"
        start = time.monotonic()
        try:
            raises(
                lambda: eqxshard.filter_get(placed),
                ["`filter_get` waited 1 s for process(es) [1]", "EQXSHARD_SYNC_TIMEOUT"],
                kind=TimeoutError,
            )
        finally:
            del os.environ["EQXSHARD_SYNC_TIMEOUT"]
        check(time.monotonic() - start < 60, "the wait was not bounded by the timeout")
    else:
        out = eqxshard.filter_get({"b": np.ones(3)})
        check(np.array_equal(out["b"], np.ones(3)), "the local fetch went wrong")
        time.sleep(5)  # past process 0's timeout
    # Process 1's next check comes after process 0 stopped waiting: it raises at once
    # rather than go on alone; and process 0, whose checks no longer pair up with
    # process 1's, refuses any further check. (So this scenario must be the last.)
    if process == 0:
        words = ["an earlier cross-process check timed out"]
    else:
        words = ["`filter_shard` came to eqxshard's cross-process check", "stopped waiting"]
    start = time.monotonic()
    raises(lambda: eqxshard.filter_shard({"a": X}, mesh8(), P("data")), words, kind=TimeoutError)
    check(time.monotonic() - start < 30, "the check waited")


def main() -> None:
    process, _ = join(sys.argv)
    run_scenarios(SCENARIOS, process)


if __name__ == "__main__":
    main()
