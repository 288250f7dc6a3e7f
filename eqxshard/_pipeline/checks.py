"""The argument checks `filter_pipeline` and `pipeline_value_and_grad` share (the mesh and
its stage axis, `layer`, the counts, the stack, the batch), each a clear error before
anything runs."""

from __future__ import annotations

import math
import warnings
from typing import Any

from jax.sharding import AbstractMesh, Mesh, NamedSharding

from .. import _compat
from .._placement.targets import given_mesh
from .._tree import FallbackWarning, Flat, leaf_error, pathstr, shape_str
from .bubble import bubble_fraction


def get_mesh(verb: str, mesh: Any, axis: Any) -> Mesh | AbstractMesh:
    """`mesh` (or the ambient one), checked to have the stage axis `axis`."""
    mesh = given_mesh(verb, mesh)
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(
            f"`{verb}(axis=...)` must name the mesh axis the stages are laid out over, but "
            f"got {axis!r} and the mesh has the axes {list(mesh.axis_names)}. Pass one of "
            "them, or build the mesh with a stage axis: "
            "`jax.make_mesh((..., stages), (..., 'stage'))`."
        )
    return mesh


def check_counts(verb: str, microbatches: Any, repeats: Any, stages: int) -> None:
    for name, value in (("microbatches", microbatches), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"`{verb}({name}=...)` must be an int, but got {value!r}.")
        if value < 1:
            raise ValueError(f"`{verb}({name}=...)` must be at least 1, but got {value}.")
    if microbatches < stages:
        bubble = bubble_fraction(stages, microbatches, repeats)
        raise ValueError(
            f"`{verb}` got microbatches={microbatches}, fewer than the {stages} stages: each "
            f"stage would idle {bubble:.0%} of the time (bubble (S-1)/(M*R+S-1)), and the "
            f"circular schedule cannot run at all. Pass microbatches >= {stages} (several "
            "times the stages keeps the bubble small), or use fewer stages."
        )


def check_blocks(verb: str, blocks: Any, stages: int, repeats: int) -> None:
    """`blocks`: array leaves that share a leading (layer) dim `n`, divisible by stages x
    repeats."""
    flat = Flat(blocks)
    indices = flat.array_indices
    if not indices:
        raise ValueError(
            f"`{verb}` got `blocks` with no array leaves. Pass the stacked layers, e.g. "
            "`eqx.filter_vmap(make_block)(jax.random.split(key, n))`."
        )
    dims = {i: (flat.leaves[i].shape[0] if flat.leaves[i].ndim else None) for i in indices}
    counts: dict[int | None, int] = {}
    for d in dims.values():
        counts[d] = counts.get(d, 0) + 1
    n = max(counts, key=lambda d: (d is not None, counts[d]))
    bad = [i for i in indices if dims[i] != n or n is None]
    if bad:
        rows = [(pathstr(flat.paths[i]), f"shape {shape_str(flat.leaves[i].shape)}") for i in bad]
        raise ValueError(
            leaf_error(
                f"`{verb}` needs every array leaf of `blocks` to have the same leading (layer) "
                f"dim; most have {n}, but these do not:",
                rows,
                "Stack every leaf of the layers along a leading dim "
                "(`eqx.filter_vmap(make_block)(keys)`), and keep what all layers share as "
                "a non-array leaf or a static field.",
            )
        )
    assert n is not None
    if n % (stages * repeats):
        raise ValueError(
            f"`{verb}` cannot split {n} layers (the leading dim of `blocks`) into {stages} "
            f"stages x {repeats} repeats = {stages * repeats} equal chunks. Use a layer count "
            f"divisible by {stages * repeats}, or change `repeats` or the size of the stage axis."
        )


def _batch_axes(leaf: Any, mesh: Mesh | AbstractMesh, axis: str) -> tuple[str, ...]:
    """The mesh axes (other than `axis`) the batch dim of `leaf` is known to be split over."""
    sharding = getattr(leaf, "sharding", None) if not _compat.is_tracer(leaf) else None
    if not isinstance(sharding, NamedSharding):
        sharding = _compat.traced_sharding(leaf)
    if sharding is None or not leaf.ndim:
        return ()
    entries = _compat.spec_entries(sharding.spec)
    entry = entries[0] if entries else None
    names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    return tuple(a for a in names if a != axis and a in mesh.axis_names)


def array_leaves(verb: str, name: str, tree: Any, expected: str, fix: str) -> Flat:
    """`tree` (the argument `name`) flattened, after a `TypeError` naming each of its
    non-array leaves, or saying it has none."""
    flat = Flat(tree)
    others = [i for i in range(len(flat.leaves)) if i not in set(flat.array_indices)]
    if others or not flat.leaves:
        rows = [(pathstr(flat.paths[i]), type(flat.leaves[i]).__name__) for i in others]
        raise TypeError(
            leaf_error(
                f"`{verb}` needs `{name}` to be an array or a PyTree of arrays ({expected}), "
                "but got these non-array leaves:",
                rows or [(f"(the whole of `{name}`)", "no leaves")],
                fix,
            )
        )
    return flat


def batch_size(
    verb: str, x: Any, mesh: Mesh | AbstractMesh, axis: str, microbatches: int
) -> tuple[int, tuple[str, ...]]:
    """The leading (batch) dim every leaf of `x` shares, and the mesh axes it is split over
    (those of the leaf split over the most); the size is divisible by `microbatches` times
    the data-parallel parts."""
    flat = array_leaves(
        verb,
        "x",
        x,
        "with a leading batch dim",
        "Pass arrays (`jnp.asarray(...)`); give `layer` other values by closure or as "
        "non-array leaves of `blocks`.",
    )
    leaves = [(p, a) for p, a in zip(flat.paths, flat.leaves, strict=True)]
    sizes = {a.shape[0] if a.ndim else None for _, a in leaves}
    sizes_of = dict(mesh.shape)
    found = [_batch_axes(a, mesh, axis) for _, a in leaves]
    batch_axes = max(found, key=lambda names: math.prod(sizes_of[n] for n in names))
    parts = math.prod(sizes_of[n] for n in batch_axes)
    if len(sizes) != 1 or None in sizes:
        rows = [(pathstr(p), f"shape {shape_str(a.shape)}") for p, a in leaves]
        raise ValueError(
            leaf_error(
                f"`{verb}` needs every leaf of `x` to have the same leading (batch) dim:",
                rows,
                "Give every leaf of `x` the batch as its leading dim.",
            )
        )
    (size,) = sizes
    assert size is not None
    if size % (microbatches * parts):
        split = f" x {parts} data-parallel parts" if parts > 1 else ""
        raise ValueError(
            f"`{verb}` cannot cut the batch of `x` ({size}) into microbatches={microbatches}"
            f"{split}: {size} is not divisible by {microbatches * parts}. Pass a batch "
            f"divisible by {microbatches * parts}, or another `microbatches`."
        )
    return size, batch_axes


# Mesh axes whose name says they split the batch (`data`, `fsdp`, `batch`, `dp`, ...): a
# model's `model`/`tensor`/`expert` axes are never asked to split it.
_DATA_WORDS = ("data", "batch", "fsdp", "dp", "replica")


def warn_unsplit(
    verb: str, size: int, microbatches: int, mesh: Mesh | AbstractMesh, axis: str
) -> None:
    """Warns when the batch, not split over the mesh's data axes, cuts into microbatches
    that those axes cannot split either: each device of them then runs every row (the
    result is right, the data parallelism is lost)."""
    sizes = dict(mesh.shape)
    data = [a for a in mesh.axis_names if a != axis and sizes[a] > 1]
    data = [a for a in data if any(word in a.lower() for word in _DATA_WORDS)]
    parts = math.prod(sizes[a] for a in data)
    rows = size // microbatches
    if data and rows % parts:
        named = " x ".join(f"{a!r} ({sizes[a]})" for a in data)
        warnings.warn(
            f"`{verb}` runs each microbatch replicated over the mesh's data axes {named}: "
            f"the batch of {size} cut into microbatches={microbatches} gives microbatches "
            f"of {rows} rows, which do not split over {parts} devices. The result is the "
            f"same, but every device of those axes does all the work. Pass a batch "
            f"divisible by microbatches x data = {microbatches * parts} (e.g. "
            f"{-(-size // (microbatches * parts)) * microbatches * parts}), or another "
            "`microbatches`.",
            FallbackWarning,
            stacklevel=4,
        )


def check_layer(verb: str, layer: Any) -> None:
    if not callable(layer):
        raise TypeError(
            f"`{verb}` needs `layer` to be a callable `layer(block, h) -> h`, but got "
            f"{type(layer).__name__}."
        )
