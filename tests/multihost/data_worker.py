"""Data from every host, never gathered: one of 2 processes x 4 CPU devices.

    python data_worker.py PORT PROCESS_ID NUM_PROCESSES WORKDIR

`WORKDIR` holds one file of rows per process (`rows-0.npy`, `rows-1.npy`, written by
`test_data_multihost.py`); each process reads only its own. Every call of
`process_allgather` (JAX's, and the one eqxshard goes through) is recorded, so a
scenario can say what crossed between hosts: never the batch data.
"""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P
from worker_common import check, join, run_scenarios

import eqxshard
from eqxshard import _compat

SCENARIOS: dict[str, Callable[[int, Path], None]] = {}
GATHERED: list[int] = []  # the bytes passed to each `process_allgather` call


def scenario(fn: Callable[[int, Path], None]) -> Callable[[int, Path], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


def _recording(gather: Callable[..., Any]) -> Callable[..., Any]:
    def recorded(tree: Any, *args: Any, **kwargs: Any) -> Any:
        leaves = jax.tree_util.tree_leaves(tree)
        GATHERED.append(sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in leaves))
        return gather(tree, *args, **kwargs)

    return recorded


multihost_utils.process_allgather = _recording(multihost_utils.process_allgather)
_compat.process_allgather = _recording(_compat.process_allgather)

ROWS, FEATURES = 16, 8  # rows per process


def load_rows(workdir: Path, process: int) -> np.ndarray:
    """The per-host data loader: this process's own file, and nothing else."""
    return np.load(workdir / f"rows-{process}.npy")


def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((jax.device_count(),), ("data",))


@scenario
def process_local_batch_is_built_without_a_gather(process: int, workdir: Path) -> None:
    local = load_rows(workdir, process)
    GATHERED.clear()
    # `filter_shard` is typed `(tree: T) -> T`; a NumPy leaf comes back as a `jax.Array`.
    batch: jax.Array = eqxshard.filter_shard(local, mesh(), P("data"), process_local=True)  # pyright: ignore[reportAssignmentType]
    check(GATHERED == [], f"process_allgather was called: {GATHERED} bytes")
    check(batch.shape == (2 * ROWS, FEATURES), f"global shape {batch.shape}")
    # This process's devices hold exactly its own rows, in order.
    shards = sorted(batch.addressable_shards, key=lambda s: s.index[0].start)
    held = np.concatenate([np.asarray(s.data) for s in shards])
    check(np.array_equal(held, local), "the local shards are not this process's rows")
    check(
        {s.index[0].start // (ROWS // 4) for s in shards}
        == set(range(4 * process, 4 * process + 4)),
        f"rows placed elsewhere: {[s.index for s in shards]}",
    )


@scenario
def host_memory_is_bounded_by_the_local_share(process: int, workdir: Path) -> None:
    """Building a 2 MiB global batch from 1 MiB per process allocates no second MiB on
    the host (NumPy allocations, as `tracemalloc` sees them): nothing global is made."""
    local = np.full((4096, 64), process, np.float32)  # 1 MiB
    m = mesh()
    eqxshard.filter_shard(np.zeros((8, 64), np.float32), m, P("data"), process_local=True)
    tracemalloc.start()
    batch: jax.Array = eqxshard.filter_shard(local, m, P("data"), process_local=True)  # pyright: ignore[reportAssignmentType]
    batch.block_until_ready()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    check(batch.shape == (8192, 64), f"global shape {batch.shape}")
    check(
        peak < local.nbytes // 2, f"{peak} bytes allocated on the host for a {local.nbytes} share"
    )


@scenario
def a_per_host_loader_feeds_the_step(process: int, workdir: Path) -> None:
    m = mesh()
    model = eqxshard.filter_replicate(eqx.nn.Linear(FEATURES, 1, key=jax.random.key(0)), m)

    @eqxshard.filter_jit(
        in_shardings=(None, P("data")), out_shardings=P(), mesh=m, move_inputs=False
    )
    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    GATHERED.clear()
    x = eqxshard.filter_shard(load_rows(workdir, process), m, P("data"), process_local=True)
    value = loss(model, x)  # laid out already: `move_inputs=False` would raise otherwise
    check(GATHERED == [], f"process_allgather was called: {GATHERED} bytes")
    # The oracle (test-side only): the loss over both files, computed on this host.
    every = np.concatenate([np.load(workdir / f"rows-{p}.npy") for p in range(2)])
    want = float(np.mean((every @ np.asarray(model.weight).T + np.asarray(model.bias)) ** 2))
    got = float(np.asarray(value.addressable_shards[0].data))
    check(abs(got - want) < 1e-4 * max(1.0, abs(want)), f"loss {got} != {want}")


@scenario
def stream_sends_chunks_without_gathering_them(process: int, workdir: Path) -> None:
    every = np.concatenate([np.load(workdir / f"rows-{p}.npy") for p in range(2)])
    GATHERED.clear()
    sums = eqxshard.filter_stream(
        lambda x: x.sum(), batch_size=jax.device_count(), mesh=mesh(), progress=False
    )(every)
    check(np.allclose(sums, every.sum(axis=1), rtol=1e-5), "wrong results")
    chunk = jax.device_count() * FEATURES * every.itemsize
    check(all(n < chunk for n in GATHERED), f"a chunk's worth was gathered: {GATHERED}")


class RecordedRows:
    """An h5py-like dataset (`shape`, `dtype`, row slicing) that records the rows read."""

    def __init__(self, data: np.ndarray) -> None:
        self.data, self.shape, self.dtype = data, data.shape, data.dtype
        self.reads: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, _ = rows.indices(len(self.data))
        self.reads.append((start, stop))
        return self.data[rows]


@scenario
def stream_reads_only_this_hosts_rows(process: int, workdir: Path) -> None:
    """A dataset every process opens (h5py, zarr, `np.memmap`): each reads only the rows
    of each chunk its own devices hold, never the other host's."""
    every = np.concatenate([np.load(workdir / f"rows-{p}.npy") for p in range(2)])
    dataset = RecordedRows(every)
    size = jax.device_count()  # 8 rows a chunk: 4 for each process's 4 devices
    sums = eqxshard.filter_stream(
        lambda x: x.sum(), batch_size=size, mesh=mesh(), in_axes=0, progress=False
    )(dataset)
    check(np.allclose(sums, every.sum(axis=1), rtol=1e-5), "wrong results")
    mine = {d.id for d in jax.local_devices()}
    order = [d.id for d in mesh().devices.flat]
    own = [i for i, d in enumerate(order) if d in mine]  # this host's row of each chunk
    for start, stop in dataset.reads:
        chunk, first = divmod(start, size)
        rows = range(first, first + (stop - start))
        check(
            all(r in own for r in rows),
            f"read rows {start}:{stop} of chunk {chunk}; this host holds {own} of each",
        )
    check(len(dataset.reads) > 0, "nothing was read")


if __name__ == "__main__":
    process, rest = join(sys.argv)
    run_scenarios(SCENARIOS, process, Path(rest[0]))
