"""Checkpoint B (saved by 2 processes x 4 devices, see `checkpoint_worker.py`) restored by
4 processes x 4 CPU devices: a restore onto more processes than saved it.

    python restore4_worker.py PORT PROCESS_ID 4 WORKDIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from checkpoint_worker import check_bit_exact, check_layout, check_types, make_model
from jax.sharding import PartitionSpec as P
from worker_common import check, join, run_scenarios

from eqxshard import filter_restore


def restore_on_four_processes(process: int, workdir: Path) -> None:
    """On 8 devices spread over the 4 processes (2 each), and on all 16 as (4, 4)."""
    like = eqx.filter_eval_shape(make_model, jax.random.key(0))
    expected = dict(np.load(workdir / "b.npz"))
    spread = jax.make_mesh((8,), ("data",), devices=jax.devices()[::2])
    grid = jax.make_mesh((4, 4), ("proc", "dev"))
    for mesh, spec in ((spread, P("data")), (grid, P("proc"))):
        check(len({d.process_index for d in mesh.devices.flat}) == 4, "a mesh over 4 processes")
        out = filter_restore(workdir / "b", like, mesh, spec, step=1)
        check_layout(out, mesh, dict.fromkeys(expected, spec), f"B on {dict(mesh.shape)}")
        check_types(out, like, f"B on {dict(mesh.shape)}")
        check_bit_exact(out, expected, f"B on {dict(mesh.shape)}")


if __name__ == "__main__":
    process, (workdir,) = join(sys.argv)
    run_scenarios({"restore_on_four_processes": restore_on_four_processes}, process, Path(workdir))
