"""One process of the multi-host run of `test_pipeline_multihost.py`: 2 processes x 4 CPU
devices, the stage axis across both processes.

    python pipeline_worker.py PORT PROCESS_ID NUM_PROCESSES

Each scenario computes the one-process result (`jax.lax.scan` over the same layers on this
process's first device) and checks that `filter_pipeline` over the 8 devices of both
processes gives it: values and gradients, gathered with `filter_get`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P
from worker_common import check, join, run_scenarios

import eqxshard

SCENARIOS: dict[str, Callable[[int], None]] = {}


def scenario(fn: Callable[[int], None]) -> Callable[[int], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


def layer(block: Any, h: jax.Array) -> jax.Array:
    return jnp.tanh(h @ block["w"] + block["b"])


def host_data(n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)  # the same on every process
    blocks = {
        "w": (rng.standard_normal((n, 4, 4)) * 0.6).astype(np.float32),
        "b": (rng.standard_normal((n, 4)) * 0.1).astype(np.float32),
    }
    return blocks, rng.standard_normal((16, 4)).astype(np.float32)


def loss(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    return lambda blocks, x: jnp.sum(jnp.sin(fn(blocks, x)))


def one_process(blocks: Any, x: Any) -> Any:
    local = jax.local_devices()[0]
    blocks, x = jax.device_put((blocks, x), local)
    scan = lambda b, x: jax.lax.scan(lambda h, w: (layer(w, h), None), x, b)[0]
    out = jax.jit(scan)(blocks, x)
    grads = jax.jit(jax.grad(loss(scan), argnums=(0, 1)))(blocks, x)
    return np.asarray(out), jax.tree.map(np.asarray, grads)


def check_pipeline(mesh: Any, xspec: P, repeats: int) -> None:
    blocks_host, x_host = host_data(mesh.shape["stage"] * repeats * 2)
    want_out, want_grads = one_process(blocks_host, x_host)
    blocks = eqxshard.filter_shard(blocks_host, mesh, eqxshard.stages())
    x = eqxshard.filter_shard(x_host, mesh, xspec)
    w = blocks["w"]
    check(isinstance(w, jax.Array) and not w.is_fully_addressable, "the stack spans processes")

    schedule = "gpipe" if repeats == 1 else "circular"

    def pipe(blocks: Any, x: Any) -> Any:
        return eqxshard.filter_pipeline(
            layer, blocks, x, mesh=mesh, microbatches=8, schedule=schedule, repeats=repeats
        )

    out = eqxshard.filter_get(jax.jit(pipe)(blocks, x))
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    grads = eqxshard.filter_get(jax.jit(jax.grad(loss(pipe), argnums=(0, 1)))(blocks, x))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@scenario
def stages_across_processes_equal_one_process(process: int) -> None:
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((8,), ("stage",), axis_types=(kind,))
        for repeats in (1, 2):
            check_pipeline(mesh, P(), repeats)


@scenario
def data_and_stages_across_processes_equal_one_process(process: int) -> None:
    devices = np.array(jax.devices()).reshape(2, 4).T  # each stage pair spans both processes
    mesh = jax.sharding.Mesh(devices, ("stage", "data"), axis_types=(AxisType.Explicit,) * 2)
    check_pipeline(mesh, P("data"), 1)


def main() -> None:
    process, _ = join(sys.argv)
    run_scenarios(SCENARIOS, process)


if __name__ == "__main__":
    main()
