"""Checkpoints saved with N processes and restored with M: one run of 8 CPU devices.

    python -m eqxshard.launch -n N --devices-per-process 8/N -- resize_worker.py \\
        WORKDIR SAVE_AS [RESTORE ...]

Joins the run with `eqxshard.initialize()`, builds the same tree on every run (values
from NumPy, independent of the process count), places it FSDP over all 8 devices of
the run, and, if `SAVE_AS` is not `-`, saves it to `WORKDIR/SAVE_AS`. Then it restores
each checkpoint `WORKDIR/RESTORE` into this run's layout and checks, on every process,
that each of its shards holds the saved values bit for bit. Process 0 prints
`saved SAVE_AS from N processes` and `restored NAME on N processes: <sha256>` (a hash
of every value, gathered from all processes).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import AxisType

import eqxshard


def make_tree() -> dict[str, np.ndarray | np.generic]:  # "step" is a NumPy scalar
    rng = np.random.default_rng(7)
    return {
        "weight": rng.normal(size=(64, 24)).astype(np.float32),
        # float16, not bfloat16: a host bfloat16 array fails filter_shard on several
        # processes (_multihost._checksum: "cannot include dtype 'E' in a buffer").
        "bias": rng.normal(size=(40,)).astype(np.float16),  # 40: padded over 8 devices
        "count": np.arange(16, dtype=np.int32).reshape(8, 2),
        "step": np.int32(11),
    }


def digest(tree: dict[str, np.ndarray | np.generic]) -> str:
    h = hashlib.sha256()
    for name in sorted(tree):
        h.update(np.ascontiguousarray(tree[name]).tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    workdir, save_as, *restore = sys.argv[1:]
    eqxshard.initialize(initialization_timeout=120, heartbeat_timeout_seconds=10)
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    rule = eqxshard.fsdp("data", min_size=0)
    expected = make_tree()
    log = print if jax.process_index() == 0 else (lambda *a, **k: None)
    if save_as != "-":
        tree = eqxshard.filter_shard(expected, mesh, rule)
        eqxshard.filter_save(Path(workdir) / save_as, 1, tree)
        log(f"saved {save_as} from {jax.process_count()} processes", flush=True)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), expected)
    for name in restore:
        restored = eqxshard.filter_restore(Path(workdir) / name, like, mesh, rule, step=1)
        for key, leaf in restored.items():
            want = eqxshard.filter_shardings(like, mesh, rule)[key]
            if not leaf.sharding.is_equivalent_to(want, leaf.ndim):
                raise AssertionError(f"{key}: sharding {leaf.sharding}, planned {want}")
            whole = np.asarray(expected[key])  # "step" is a NumPy scalar
            for shard in leaf.addressable_shards:  # this process's part, bit for bit
                if not np.array_equal(np.asarray(shard.data), whole[shard.index]):
                    raise AssertionError(f"{name}: {key}{shard.index} differs from the saved")
        gathered = eqxshard.filter_get(restored)  # a collective: every process takes part
        log(f"restored {name} on {jax.process_count()} processes: {digest(gathered)}", flush=True)
    log(f"expected {digest(expected)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
