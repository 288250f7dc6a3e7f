"""Checkpoints on a real multi-host run: one of 2 processes x 4 CPU devices on 127.0.0.1.

`test_checkpoint_multihost.py` saves checkpoint A in its own process (8 devices), starts
two of these, and afterwards restores the checkpoint B they wrote in its own process:

    python checkpoint_worker.py PORT PROCESS_ID NUM_PROCESSES WORKDIR

`WORKDIR` holds `a/` (saved on 8 devices in one process) with `a.npz` (its values), and
receives `b/` (saved here from both processes) with `b.npz`. Each process runs every
scenario in order and prints one JSON line per scenario:
`{"scenario": name, "process": id, "ok": bool, "error": traceback or null}`.
Values are compared bit for bit (`np.array_equal` on the raw values, PRNG keys as key
data) with those of the tree that was saved.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from worker_common import check, join, run_scenarios

import eqxshard
from eqxshard import filter_restore, filter_save, latest_step

SCENARIOS: dict[str, Callable[[int, Path], None]] = {}


def scenario(fn: Callable[[int, Path], None]) -> Callable[[int, Path], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


# ------------------------------------------------ the model, shared with the test module


class Model(eqx.Module):
    """Float32, bfloat16 and int32 arrays, a PRNG key array and static fields."""

    weight: jax.Array
    bias: jax.Array
    count: jax.Array
    keys: jax.Array
    activation: Callable[[jax.Array], jax.Array]
    width: int = eqx.field(static=True)


def make_model(key: jax.Array) -> Model:
    k1, k2, k3 = jax.random.split(key, 3)
    return Model(
        weight=jax.random.normal(k1, (16, 8)),
        bias=jax.random.normal(k2, (8,)).astype(jnp.bfloat16),
        count=jnp.arange(8, dtype=jnp.int32) * 3,
        keys=jax.random.split(k3, 8),
        activation=jax.nn.gelu,
        width=8,
    )


def as_numpy(tree: Any) -> dict[str, np.ndarray]:
    """The array leaves of `tree`, whole on every process, by dotted path (keys as their
    data, bfloat16 as its bits)."""
    host = eqxshard.filter_get(tree)
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(host)[0]:
        if eqx.is_array(leaf):
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            leaf = np.asarray(leaf)
            if leaf.dtype == jnp.bfloat16:  # `.npz` cannot hold bfloat16: keep its bits
                leaf = leaf.view(np.uint16)
            out[eqxshard.rules.dotted_path(path)] = leaf
    return out


def check_bit_exact(tree: Any, expected: dict[str, np.ndarray], what: str) -> None:
    got = as_numpy(tree)
    check(set(got) == set(expected), f"{what}: leaves {sorted(got)} != {sorted(expected)}")
    for name, value in expected.items():
        check(got[name].dtype == value.dtype, f"{what}: {name} dtype {got[name].dtype}")
        # bit for bit: compare the raw bytes (bfloat16 included)
        check(
            got[name].shape == value.shape and got[name].tobytes() == value.tobytes(),
            f"{what}: {name} differs from the saved value",
        )


def check_layout(tree: Any, mesh: Any, specs: dict[str, P], what: str) -> None:
    """Each array leaf is laid out as `specs` says, on every device of `mesh`."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not eqx.is_array(leaf):
            continue
        name = eqxshard.rules.dotted_path(path)
        wanted = NamedSharding(mesh, specs[name])
        ndim = len(leaf.shape)
        check(
            leaf.sharding.is_equivalent_to(wanted, ndim),
            f"{what}: {name} is {leaf.sharding}, not {wanted}",
        )
        check(len(leaf.sharding.device_set) == mesh.size, f"{what}: {name} device set")


def check_types(out: Model, like: Model, what: str) -> None:
    """Statics are `like`'s; dtypes are those saved (keys are key arrays again)."""
    check(out.activation is like.activation, f"{what}: activation is not `like`'s")
    check(out.width == like.width, f"{what}: width")
    check(out.bias.dtype == jnp.bfloat16 and out.count.dtype == jnp.int32, f"{what}: dtypes")
    check(jnp.issubdtype(out.keys.dtype, jax.dtypes.prng_key), f"{what}: keys not key arrays")


# ----------------------------------------------------------------------------- scenarios


def global_mesh_2x4() -> Any:
    # (2, 4): axis "proc" follows the process boundary, "dev" runs within one process.
    return jax.make_mesh((2, 4), ("proc", "dev"), axis_types=(AxisType.Explicit,) * 2)


SPECS_2X4 = {
    "weight": P("dev", "proc"),
    "bias": P("dev"),
    "count": P(("proc", "dev")),
    "keys": P("proc"),
}


@scenario
def restore_one_process_save_on_two_processes(process: int, workdir: Path) -> None:
    """Checkpoint A was saved by one process on a (8,) mesh; read it here on (2, 4)."""
    mesh = global_mesh_2x4()
    like = eqx.filter_eval_shape(make_model, jax.random.key(1))
    rules = eqxshard.path_rules(list(SPECS_2X4.items()))
    out = filter_restore(workdir / "a", like, mesh, rules)
    check(not out.weight.is_fully_addressable, "weight is not a global array")
    check_layout(out, mesh, SPECS_2X4, "restore A on (2, 4)")
    check_types(out, like, "restore A on (2, 4)")
    expected = dict(np.load(workdir / "a.npz"))
    check_bit_exact(out, expected, "restore A on (2, 4)")
    # This process's shards only: each holds its own devices' part of each array.
    for shard in out.weight.addressable_shards:
        check(shard.device.process_index == process, "a shard on another process")
        check(
            np.asarray(shard.data).tobytes() == expected["weight"][shard.index].tobytes(),
            "a local shard of weight differs",
        )


@scenario
def save_on_two_processes(process: int, workdir: Path) -> None:
    """Checkpoint B: saved from both processes (step 1 synchronously, step 2 in the
    background); `b.npz` holds the values of step 1 for the test process to compare."""
    mesh = global_mesh_2x4()
    model = eqxshard.filter_init(make_model, mesh, eqxshard.fsdp("dev", min_size=0))(
        jax.random.key(2)
    )
    check(not model.weight.is_fully_addressable, "the saved model spans both processes")
    handle = filter_save(workdir / "b", 1, model)
    check(handle.done(), "a waited save is done")
    expected = as_numpy(model)
    if process == 0:
        # cast: NumPy types `allow_pickle` among `savez`'s keywords; these are leaf paths.
        np.savez(workdir / "b.npz", **cast(dict[str, Any], expected))
    doubled = eqx.tree_at(lambda m: m.weight, model, model.weight * 2)
    pending = filter_save(workdir / "b", 2, doubled, wait=False)
    pending.wait()
    check(latest_step(workdir / "b") == 2, f"latest step {latest_step(workdir / 'b')}")
    like = eqx.filter_eval_shape(make_model, jax.random.key(0))
    out = filter_restore(workdir / "b", like, mesh, eqxshard.fsdp("proc", min_size=0))
    expected_2 = dict(expected, weight=expected["weight"] * 2)
    check_bit_exact(out, expected_2, "restore B step 2 on (2, 4)")


@scenario
def restore_on_a_flat_global_mesh(process: int, workdir: Path) -> None:
    """Step 1 of B (saved with fsdp over "dev" of (2, 4)) read back on a (8,) mesh."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    like = eqx.filter_eval_shape(make_model, jax.random.key(0))
    out = filter_restore(workdir / "b", like, mesh, P("data"), step=1)
    specs = dict.fromkeys(SPECS_2X4, P("data"))
    check_layout(out, mesh, specs, "restore B on (8,)")
    check_types(out, like, "restore B on (8,)")
    check_bit_exact(out, dict(np.load(workdir / "b.npz")), "restore B on (8,)")


@scenario
def mismatch_raises_on_every_process(process: int, workdir: Path) -> None:
    """A `like` that does not match raises the same error on both processes, before any
    read; both stay in step (the collective after it completes)."""
    mesh = global_mesh_2x4()
    like = eqx.filter_eval_shape(make_model, jax.random.key(0))
    wrong = eqx.tree_at(lambda m: m.weight, like, jax.ShapeDtypeStruct((8, 16), jnp.float32))
    try:
        filter_restore(workdir / "b", wrong, mesh)
    except ValueError as e:
        check("weight" in str(e) and "(16, 8)" in str(e), str(e))
    else:
        raise AssertionError("no error for a shape that differs")
    total = eqxshard.filter_get(eqxshard.filter_shard(jnp.arange(8.0), mesh, P(("proc", "dev"))))
    check(float(total.sum()) == 28.0, "the processes are still in step")


def main() -> None:
    process, (workdir,) = join(sys.argv)
    run_scenarios(SCENARIOS, process, Path(workdir))


if __name__ == "__main__":
    main()
