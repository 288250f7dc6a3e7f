"""The plain scan over a layer stack (what every pipeline is checked against, and what a
`Stacked` runs without a stage axis), and the layer count every array leaf of a stack
shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ... import _compat
from ..._placement import place
from ..._tree import is_array_like, leaf_error, pathstr, shape_str
from ..remat import with_remat
from ..spmd.stage_major import from_stage_major


def scan_layers(
    layer: Callable[[Any, Any], Any],
    blocks: Any,
    h: Any,
    remat: str = "none",
    stage_major: tuple[int, int] | None = None,
) -> Any:
    """`h` through every layer of `blocks` in order, as one `lax.scan` over the layer dim:
    the reference every pipeline is checked against. `stage_major=(S, R)`: `blocks` is
    stored stage-major for `S` stages and `R` repeats (`spmd.stage_major`), and is put
    back in layer order first."""
    params, static = eqx.partition(blocks, eqx.is_array)

    def step(h: Any, p: Any) -> tuple[Any, None]:
        return layer(eqx.combine(p, static), h), None

    params = jax.tree.map(whole_layer_dim, params)
    if stage_major is not None:
        params = from_stage_major(params, *stage_major)
    return jax.lax.scan(with_remat(step, remat), h, params)[0]


def whole_layer_dim(x: Any) -> Any:
    """`x` with its layer dim whole where Explicit mesh axes split it (e.g. over the
    stages), which `lax.scan` refuses to scan over and slicing a layer out of refuses
    to guess the layout of: every device then holds every layer. Traced or concrete."""
    tracer = _compat.is_tracer(x)
    sharding = _compat.traced_sharding(x) if tracer else getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return x
    entries = _compat.spec_entries(sharding.spec)
    first = entries[0] if entries else None
    names = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    types = _compat.axis_type_map(sharding.mesh)
    if not any(types.get(n) == AxisType.Explicit for n in names):
        return x
    whole = NamedSharding(sharding.mesh, PartitionSpec(None, *entries[1:]))
    return _compat.reshard_explicit(x, whole) if tracer else place.relayout(x, whole)


def layer_count(blocks: Any, *, argname: str, verb: str) -> int:
    """The leading dim every array leaf of `blocks` shares, or a `ValueError` listing the
    leaves that disagree (or have no dims)."""
    leaves = [
        (path, leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(blocks)[0]
        if is_array_like(leaf)  # abstract stacks too: `auto_plan` configures them
    ]
    if not leaves:
        raise ValueError(
            f"`{verb}` got a `{argname}` with no array leaves; expected a stack of blocks "
            "whose array leaves share a leading layer dim. Build it with "
            "`eqx.filter_vmap(make_block)(jax.random.split(key, n))`."
        )
    dims = [leaf.shape[0] if leaf.ndim else None for _, leaf in leaves]
    counts: dict[int, int] = {}
    for d in dims:
        if d is not None:
            counts[d] = counts.get(d, 0) + 1
    n = max(counts, key=lambda d: counts[d]) if counts else None
    bad = [
        (pathstr(p), f"shape {shape_str(x.shape)}")
        for (p, x), d in zip(leaves, dims, strict=True)
        if d != n
    ]
    if n is None or bad:
        rows = bad or [(pathstr(p), "shape ()") for p, _ in leaves]
        raise ValueError(
            leaf_error(
                f"`{verb}` needs every array leaf of `{argname}` to have the same leading "
                f"(layer) dim; most have {n}, these do not:",
                rows,
                "Stack the blocks with `eqx.filter_vmap(make_block)(keys)` or "
                "`Stacked.from_layers([...])`, and keep arrays that every layer shares "
                "outside the stack (or as non-array leaves).",
            )
        )
    return n
