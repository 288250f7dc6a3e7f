"""`describe`: one row per array leaf (path, shape, dtype, spec, bytes per device), and
the total bytes on each device, for a plan or for a tree already placed."""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import (
    AbstractMesh,
    NamedSharding,
    PartitionSpec,
    Sharding,
    SingleDeviceSharding,
)
from jaxtyping import PyTree

from .. import _compat
from .._placement import spec_tree
from .._tree import Flat, device_name, is_array_like
from .by_stage import stage_major_paths
from .plan import plan_shardings
from .rules import dotted_path
from .table import LeafRow, ShardingTable

# How many of the largest unsharded leaves a table lists.
UNSHARDED_SHOWN = 5


def _spec_str(sharding: Sharding | None) -> str:
    if sharding is None:
        return "-"
    if isinstance(sharding, NamedSharding):
        entries = ", ".join(repr(e) for e in sharding.spec)
        return f"P({entries})"
    if isinstance(sharding, SingleDeviceSharding):
        return f"device {device_name(next(iter(sharding.device_set)))}"
    return type(sharding).__name__


def _per_device(sharding: Sharding, shape: tuple[int, ...], itemsize: int) -> dict[Any, int]:
    """The bytes of one leaf on each device of its sharding (padded shards, as XLA pads)."""
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
        # No devices (a mesh to size a run before having it, or inside `jit`): each
        # position of the mesh, 0 to size - 1, stands for a device.
        devices = range(sharding.mesh.size)
    else:
        try:
            devices = sharding.device_set
        except Exception:  # no devices to count
            return {}
    if isinstance(sharding, NamedSharding):
        sizes = dict(sharding.mesh.shape)
        shard = list(shape)
        for dim, entry in enumerate(sharding.spec):
            if entry is None or entry is PartitionSpec.UNCONSTRAINED:
                continue
            names = entry if isinstance(entry, tuple) else (entry,)
            shard[dim] = -(-shape[dim] // math.prod(sizes[n] for n in names))
        return dict.fromkeys(devices, math.prod(shard) * itemsize)
    indices = sharding.devices_indices_map(shape)
    return {
        d: math.prod(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))
        * itemsize
        for d, index in indices.items()
    }


# The memory kinds of host memory: leaves there count as host bytes, not device bytes.
HOST_KINDS = ("pinned_host", "unpinned_host")


def _host_kind(sharding: Sharding | None) -> str | None:
    """The host memory kind `sharding` puts its leaf in, or `None` for device memory."""
    kind = getattr(sharding, "memory_kind", None)
    return kind if kind in HOST_KINDS else None


def _own_sharding(x: Any) -> Sharding | None:
    if _compat.is_tracer(x):
        return _compat.traced_sharding(x)
    sharding = getattr(x, "sharding", None)  # jax.Array, jax.ShapeDtypeStruct
    return sharding if isinstance(sharding, Sharding) else None


def describe(tree: PyTree, target: Any = None, spec: Any = None) -> ShardingTable:
    """A table of where each array leaf lives and how many bytes each device holds.

    With a `target` or `spec`, it describes the plan: the layout `filter_shard(tree,
    target, spec)` would give, checked the same way, without placing or allocating
    anything, so `tree` may be abstract (`eqx.filter_eval_shape(make_model, key)`).
    Without either, it reads each leaf's own sharding (a tree already placed; host NumPy
    leaves and abstract leaves without a sharding show as not placed).

    One row per array leaf: its dotted path (the form `path_rules` match), shape, dtype,
    spec, the bytes of it on one device, and its total bytes. Below: the bytes on each
    device, and the largest leaves left whole on every device, and the parts of the rules
    of `spec` that gave no leaf its spec (a `path_rules` pattern with a typo, named with
    the paths closest to it: listed, not warned about, as `describe` is often asked about
    a part of a model with the whole's rules). Leaves in host memory (a
    sharding whose `memory_kind` is `"pinned_host"`, as `filter_put(state,
    memory_kind="pinned_host")` or a `Plan` that offloads the optimiser state places
    them) count as host bytes, apart from the device bytes. For a tree of several
    parts (`describe({"params": params, "opt_state": opt_state})`), also each part's
    bytes on the fullest device: the optimiser state's next to the parameters'.

    It counts the leaves of `tree` only. A training step also holds gradients, the
    optimiser state and activations: `eqxshard.describe_step(step, model, opt_state,
    batch)` compiles the step and gives its whole footprint per device (`total_bytes`,
    and `footprint()` by part), the figure to size a budget by (the table's last line
    says so).

    **Arguments:**

    - `tree`: any PyTree, concrete or abstract (`jax.ShapeDtypeStruct` leaves).
    - `target`: as for `filter_shard`; `None` with no `spec` reads the tree's own
        shardings.
        An `AbstractMesh` of any size sizes a run before having its devices
        (see docs/sizing.md).
    - `spec`: as for `filter_shard`: a `PartitionSpec`, a callable, a rule, or a prefix
        PyTree of these (`(fsdp("data"), like(params))` for `(model, opt_state)`).

    **Returns:**

    A `ShardingTable`: `print` it in a terminal; a notebook renders it as HTML. Its
    fields (`rows`, `bytes_per_device`, `total_bytes`, `unsharded`) are plain data.

    **Raises:**

    With a `target` or `spec`: the errors of `filter_shardings`.


    !!! Example

        ```python
        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
        make_model = lambda key: eqx.nn.MLP(64, 64, 256, 2, key=key)
        abstract = eqx.filter_eval_shape(make_model, jax.random.key(0))
        print(eqxshard.describe(abstract, mesh, eqxshard.fsdp("data")))
        ```
    """
    if target is None and spec is None:
        flat = Flat(tree, is_array=is_array_like)
        shardings = {i: _own_sharding(flat.leaves[i]) for i in flat.array_indices}
    else:
        flat, planned = plan_shardings("describe", tree, target, spec, sync=False)
        shardings = {i: planned.get(i) for i in flat.array_indices}
    orders = stage_major_paths(tree)
    rows: list[LeafRow] = []
    per_device: dict[Any, int] = {}
    by_part: dict[str, dict[Any, int]] = {}
    host: dict[Any, int] = {}
    for i, sharding in shardings.items():
        x = flat.leaves[i]
        shape, itemsize = tuple(x.shape), x.dtype.itemsize
        held = {} if sharding is None else _per_device(sharding, shape, itemsize)
        part = by_part.setdefault(dotted_path(flat.paths[i][:1]), {})
        kind = _host_kind(sharding)
        for device, n in held.items():
            if kind is not None:  # offloaded (`filter_put(memory_kind="pinned_host")`)
                host[device] = host.get(device, 0) + n
                continue
            per_device[device] = per_device.get(device, 0) + n
            part[device] = part.get(device, 0) + n
        replicated = sharding is not None and sharding.is_fully_replicated
        rows.append(
            LeafRow(
                path=dotted_path(flat.paths[i]),
                shape=shape,
                dtype=str(x.dtype),
                sharding=sharding,
                spec=_spec_str(sharding) + (f" in {kind}" if kind is not None else ""),
                bytes=math.prod(shape) * itemsize,
                bytes_per_device=max(held.values()) if held else None,
                replicated=replicated,
                memory_kind=kind or "device" if sharding is not None else None,
                stage_major=next(
                    (o for p, o in orders if tuple(flat.paths[i][: len(p)]) == p), None
                ),
            )
        )
    unsharded = sorted(
        (r for r in rows if r.replicated and r.sharding is not None and _size(r.sharding) > 1),
        key=lambda r: -r.bytes,
    )[:UNSHARDED_SHOWN]
    ordered = dict(sorted(per_device.items(), key=lambda item: _device_order(item[0])))
    left = {} if spec is None else _left_replicated(flat, spec, shardings)
    return ShardingTable(
        rows=rows,
        bytes_per_device=ordered,
        total_bytes=sum(r.bytes for r in rows),
        unsharded=unsharded,
        parts={k: max(v.values(), default=0) for k, v in by_part.items()}
        if len(by_part) > 1
        else {},
        left_replicated=left,
        unmatched=[] if spec is None else _unmatched(flat, spec, shardings),
        host_bytes_per_device=dict(sorted(host.items(), key=lambda item: _device_order(item[0]))),
    )


def _left_replicated(
    flat: Flat, spec: Any, shardings: dict[int, Sharding | None]
) -> dict[str, tuple[int, int]]:
    """Why the rules of `spec` left leaves whole on every device of a mesh of several:
    each reason a rule gives, with how many leaves and bytes it covers."""
    forms = spec_tree.forms_per_leaf(flat, spec, verb="describe")
    out: dict[str, tuple[int, int]] = {}
    for i, sharding in shardings.items():
        if not isinstance(sharding, NamedSharding) or sharding.mesh.size == 1:
            continue
        if not sharding.is_fully_replicated:
            continue
        form, path = forms[i]
        explain = getattr(form, "replicated_because", None) if spec_tree.is_rule(form) else None
        reason = explain(path, flat.leaves[i], sharding.mesh) if explain is not None else None
        if reason is not None:
            x = flat.leaves[i]
            n, size = out.get(reason, (0, 0))
            out[reason] = (n + 1, size + math.prod(x.shape) * x.dtype.itemsize)
    return out


def _unmatched(flat: Flat, spec: Any, shardings: dict[int, Sharding | None]) -> list[str]:
    """The parts of the rules of `spec` that gave no leaf its spec (a `path_rules` pattern
    with a typo, with the paths closest to it), as `filter_shard` warns about them."""
    forms = spec_tree.forms_per_leaf(flat, spec, verb="describe")
    asked: dict[int, tuple[Any, list[tuple[Any, Any, Any]]]] = {}
    for i, sharding in shardings.items():
        form, path = forms[i]
        if not isinstance(sharding, NamedSharding) or not spec_tree.is_rule(form):
            continue
        if getattr(form, "unused", None) is not None:
            asked.setdefault(id(form), (form, []))[1].append((path, flat.leaves[i], sharding.mesh))
    return [part for rule, seen in asked.values() for part in rule.unused(seen)]


def _device_order(device: Any) -> int:
    return device if isinstance(device, int) else device.id


def _size(sharding: Sharding) -> int:
    if isinstance(sharding, NamedSharding):
        return sharding.mesh.size
    return len(sharding.device_set)
