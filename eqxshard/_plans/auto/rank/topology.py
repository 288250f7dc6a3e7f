"""Which mesh axes cross nodes, and so which link each axis of a candidate gets.

`jax.make_mesh` (and `mesh_for`) lays devices out in order with the last axis fastest: on
a mesh `(data, fsdp, model)` the devices along `model` are neighbours, those along `data`
the farthest apart. With `devices_per_node` devices on each node, an axis crosses nodes
when it and the axes after it span more devices than one node has; it then gets the
`inter_node` link, the others `intra_node`, unless the user's `links` name it. Offload
traffic (device <-> pinned host memory) goes over the `host` link.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..links import DEFAULT_LINK, LINKS, Link, as_link

# The extra "axis" a user may give a link for in `links=`: device <-> host memory.
HOST_LINK = "host"


def check_devices_per_node(devices_per_node: Any, n: int) -> int:
    """The node size (`n` when None: every device on one node); raises for a bad one."""
    if devices_per_node is None:
        return n
    if isinstance(devices_per_node, bool) or not isinstance(devices_per_node, int):
        raise TypeError(
            "`auto_plan` takes `devices_per_node` as an int (e.g. 8) or None, but got "
            f"{type(devices_per_node).__name__}."
        )
    if devices_per_node < 1 or (n > devices_per_node and n % devices_per_node):
        raise ValueError(
            f"`auto_plan` takes `devices_per_node` >= 1 dividing the device count {n}, but "
            f"got {devices_per_node}. Give how many of the {n} devices share a node (8 on "
            "most GPU nodes)."
        )
    return devices_per_node


def crossing(shape: Mapping[str, int], devices_per_node: int) -> tuple[str, ...]:
    """The axes of `shape` (in mesh order) whose devices are on different nodes."""
    names = list(shape)
    out = []
    for i, axis in enumerate(names):
        if shape[axis] > 1 and math.prod(shape[a] for a in names[i:]) > devices_per_node:
            out.append(axis)
    return tuple(out)


def resolve(links: Any, axes: tuple[str, ...]) -> dict[str, Link]:
    """`links` as {name: Link} for the names it gives (every axis, not `host`, for one
    preset or `Link`); raises for unknown axes or presets."""
    if links is None:
        return {}
    names = (*axes, HOST_LINK)
    if isinstance(links, Mapping):
        unknown = sorted(set(links) - set(names))
        if unknown:
            raise ValueError(
                f"`auto_plan(links=...)` names axes {unknown}; the axes are {list(axes)} "
                f"and {HOST_LINK!r} (device <-> host memory). Give a link for some of these (the "
                f"others get {DEFAULT_LINK!r}, 'inter_node' for axes across nodes)."
            )
        return {a: as_link(v, f"`links[{a!r}]`") for a, v in links.items()}
    return dict.fromkeys(axes, as_link(links, "`links`"))


def axis_links(
    shape: Mapping[str, int], given: Mapping[str, Link], devices_per_node: int
) -> dict[str, Link]:
    """The link of each axis of `shape` and of `host`: the user's where given, else
    `inter_node` for the axes that cross nodes and `intra_node` for the others."""
    across = crossing(shape, devices_per_node)
    out = {a: given.get(a, LINKS["inter_node" if a in across else DEFAULT_LINK]) for a in shape}
    out[HOST_LINK] = given.get(HOST_LINK, LINKS[HOST_LINK])
    return out
