"""Host-to-accelerator transfers in parts, staged through pinned host memory.

One `jax.device_put` of one big NumPy array to a GPU is one copy from pageable host
memory, well below the link's speed. Here each big host leaf bound for an accelerator is
cut, per device it goes to, into parts of at most `part_bytes`. Each part is copied into
pinned host memory (`memory_kind="pinned_host"` on its device) and from there into the
device's memory, several parts at once on worker threads, so that staging one part
overlaps the device copy of others. The parts of one device are joined there (one small
compiled `concatenate` per layout of parts, cached) and the per-device pieces made into
one array with the asked sharding. Every step is a copy, so the result is bit-identical
to `jax.device_put`.

Two environment variables, read at every call, set what is staged and how much pinned
memory it may use:

- `EQXSHARD_STAGING`: `auto` (default) stages NumPy leaves bound for devices that are
  not CPUs; `off` never stages; `on` also stages onto CPU devices (where `device_put` of
  NumPy may not copy at all: this is for testing the path).
- `EQXSHARD_STAGING_BYTES`: the most bytes of pinned host memory staging uses at once
  (default 256 MiB). Parts are a quarter of it, four in flight. A leaf whose piece for a
  device is below an eighth of a part (at most 1 MiB) goes with the one batched
  `jax.device_put` of the other leaves instead, as do empty leaves, NumPy scalars, leaves
  already on a device and leaves bound for a host memory kind.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

MODE_VARIABLE = "EQXSHARD_STAGING"
BYTES_VARIABLE = "EQXSHARD_STAGING_BYTES"
DEFAULT_BYTES = 256 * 2**20
IN_FLIGHT = 4  # parts staged at once (worker threads)
MODES = ("auto", "off", "on")

_pool: list[ThreadPoolExecutor] = []  # made on first use


class Config(NamedTuple):
    """What is staged (`mode`) and the pinned host memory it may use at once."""

    mode: str
    staging_bytes: int

    @property
    def part_bytes(self) -> int:
        return max(1, self.staging_bytes // IN_FLIGHT)

    @property
    def min_bytes(self) -> int:
        return min(2**20, max(1, self.part_bytes // 8))


def config() -> Config:
    """The staging settings from the environment; `ValueError` for values it cannot read."""
    raw_mode = os.environ.get(MODE_VARIABLE, "")
    mode = raw_mode.strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(
            f"{MODE_VARIABLE}={raw_mode!r} is not one of {list(MODES)}. Set it to 'auto' "
            "(stage host data bound for accelerators), 'off' (never), or 'on' (also onto "
            "CPU devices, for testing)."
        )
    raw = os.environ.get(BYTES_VARIABLE, "").strip()
    try:
        staging_bytes = int(raw) if raw else DEFAULT_BYTES
    except ValueError:
        staging_bytes = 0
    if staging_bytes < 1:
        raise ValueError(
            f"{BYTES_VARIABLE}={raw!r} is not a positive whole number of bytes. Set it to "
            f"the most pinned host memory staging may use at once, e.g. {DEFAULT_BYTES} "
            "(256 MiB, the default)."
        )
    return Config(mode, staging_bytes)


def device_put(xs: Sequence[Any], shardings: Sequence[Sharding]) -> list[Any]:
    """`jax.device_put(xs, shardings)`, with big host leaves bound for accelerators staged.

    The leaves not staged go in one batched `jax.device_put`, dispatched first so that
    it runs while the staged ones are copied.
    """
    settings = config()
    if settings.mode == "off":
        return _batched(xs, shardings)
    # Decided per distinct sharding first: a model's leaves share a few, and most calls
    # (every one onto CPU devices under `auto`) stage nothing.
    targets = {id(s): s for s in shardings}
    if not any(_may_stage(s, settings) for s in targets.values()):
        return _batched(xs, shardings)
    staged = [
        k for k, (x, s) in enumerate(zip(xs, shardings, strict=True)) if _stages(x, s, settings)
    ]
    if not staged:
        return _batched(xs, shardings)
    chosen = set(staged)
    rest = [k for k in range(len(xs)) if k not in chosen]
    out: list[Any] = [None] * len(xs)
    if rest:
        moved = _batched([xs[k] for k in rest], [shardings[k] for k in rest])
        for k, x in zip(rest, moved, strict=True):
            out[k] = x
    for k, x in zip(
        staged,
        _stage([xs[k] for k in staged], [shardings[k] for k in staged], settings),
        strict=True,
    ):
        out[k] = x
    return out


def through_host(shape: tuple[int, ...], dtype: Any, sharding: Sharding) -> bool:
    """Whether data of this shape read from storage (`filter_restore`) should come to the
    host first and be staged onto `sharding`, rather than be read onto the devices."""
    if jax.process_count() > 1 or not shape or 0 in shape:
        return False
    settings = config()
    if settings.mode == "off" or not _may_stage(sharding, settings):
        return False
    like = host_placeholder(shape, dtype)
    pieces = sharding.addressable_devices_indices_map(shape).values()
    return min(like[index].nbytes for index in pieces) >= settings.min_bytes


def host_placeholder(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A NumPy array of `shape` and `dtype` that takes no memory (a broadcast view): what
    asks a reader such as Orbax for host NumPy of that shape."""
    return np.broadcast_to(np.zeros((), dtype), shape)


def _batched(xs: Sequence[Any], shardings: Sequence[Sharding]) -> list[Any]:
    """One batched `jax.device_put`. Leaves that all go to one sharding object pass it
    once: `device_put` then skips broadcasting a list of shardings over the leaves."""
    if not xs:
        return []
    first = shardings[0]
    if all(s is first for s in shardings):
        return list(jax.device_put(list(xs), first))
    return list(jax.device_put(list(xs), list(shardings)))


def _may_stage(sharding: Sharding, settings: Config) -> bool:
    """Whether leaves bound for `sharding` may be staged (the leaf aside)."""
    if (sharding.memory_kind or "device") != "device" or not sharding.is_fully_addressable:
        return False
    return settings.mode == "on" or any(d.platform != "cpu" for d in sharding.device_set)


def _stages(x: Any, sharding: Sharding, settings: Config) -> bool:
    """Whether this leaf goes through the staging path."""
    # Cheap tests first: most leaves of a model are small, and no piece outgrows its leaf.
    if type(x) is not np.ndarray or x.nbytes < settings.min_bytes:
        return False
    if not _may_stage(sharding, settings):
        return False
    pieces = sharding.addressable_devices_indices_map(x.shape).values()
    return min(x[index].nbytes for index in pieces) >= settings.min_bytes


class _Piece(NamedTuple):
    """What one device gets of one leaf: its host data, cut into parts."""

    leaf: int
    device: Any
    shape: tuple[int, ...]
    parts: list[np.ndarray]


def _stage(xs: list[np.ndarray], shardings: list[Sharding], settings: Config) -> list[jax.Array]:
    pieces: list[_Piece] = []
    for k, (x, sharding) in enumerate(zip(xs, shardings, strict=True)):
        for device, index in sharding.addressable_devices_indices_map(x.shape).items():
            host = x[index]
            per_part = max(1, settings.part_bytes // host.itemsize)
            if host.size <= per_part:
                parts = [host]
            else:
                flat = np.ascontiguousarray(host).reshape(-1)
                parts = [flat[a : a + per_part] for a in range(0, flat.size, per_part)]
            pieces.append(_Piece(k, device, host.shape, parts))
    jobs = [(piece.device, part) for piece in pieces for part in piece.parts]
    if not _pool:
        _pool.append(ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="eqxshard-staging"))
    moved = iter(list(_pool[0].map(_move, *zip(*jobs, strict=True))))
    on_device: list[list[jax.Array]] = [[] for _ in xs]
    for piece in pieces:
        parts = [next(moved) for _ in piece.parts]
        if len(parts) == 1:
            on_device[piece.leaf].append(parts[0])
        else:
            on_device[piece.leaf].append(_join(parts, piece.shape))
    return [
        jax.make_array_from_single_device_arrays(x.shape, sharding, arrays)
        for x, sharding, arrays in zip(xs, shardings, on_device, strict=True)
    ]


def _move(device: Any, part: np.ndarray) -> jax.Array:
    """One part to one device, through its pinned host memory where it has one.

    Waits for the device copy, so that at most `IN_FLIGHT` parts are staged at once.
    """
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" in kinds:
        part = jax.device_put(part, SingleDeviceSharding(device, memory_kind="pinned_host"))
    out = jax.device_put(part, SingleDeviceSharding(device))
    return out.block_until_ready()


@partial(jax.jit, static_argnames="shape")
def _join(parts: list[jax.Array], shape: tuple[int, ...]) -> jax.Array:
    return jnp.concatenate(parts).reshape(shape)
