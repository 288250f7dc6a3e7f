"""`Stacked`: a stack of blocks with a leading layer dim, run by one `jax.lax.scan`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from .. import _compat
from .._tree import is_array_like, leaf_error, pathstr, shape_str
from .batching import batched_call, batching_of
from .pipeline import filter_pipeline
from .remat import check_remat, with_remat


def scan_layers(layer: Callable[[Any, Any], Any], blocks: Any, h: Any, remat: str = "none") -> Any:
    """`h` through every layer of `blocks` in order, as one `lax.scan` over the layer dim:
    the reference every pipeline is checked against."""
    params, static = eqx.partition(blocks, eqx.is_array)

    def step(h: Any, p: Any) -> tuple[Any, None]:
        return layer(eqx.combine(p, static), h), None

    params = jax.tree.map(_whole_layer_dim, params)
    return jax.lax.scan(with_remat(step, remat), h, params)[0]


def _whole_layer_dim(x: Any) -> Any:
    """`x` with its layer dim whole where Explicit mesh axes split it (e.g. over the
    stages), which `lax.scan` refuses to scan over: every device runs every layer."""
    sharding = _compat.traced_sharding(x)
    if sharding is None:
        return x
    entries = _compat.spec_entries(sharding.spec)
    first = entries[0] if entries else None
    names = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    types = _compat.axis_type_map(sharding.mesh)
    if not any(types.get(n) == AxisType.Explicit for n in names):
        return x
    whole = NamedSharding(sharding.mesh, PartitionSpec(None, *entries[1:]))
    return _compat.reshard_explicit(x, whole)


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


def _check_pipeline(axis: Any, microbatches: Any, repeats: Any, mesh: Any) -> None:
    if axis is None:
        given = [n for n, v in (("microbatches", microbatches), ("mesh", mesh)) if v is not None]
        if given or repeats != 1:
            names = ", ".join(f"`{n}`" for n in given + (["repeats"] if repeats != 1 else []))
            raise ValueError(
                f"`Stacked` got {names} without `axis`; they configure the pipeline, which "
                'runs only over a mesh axis. Pass `axis="stage"` (the mesh axis to pipeline '
                "over) as well, or leave them out for the plain scan."
            )
        return
    if not isinstance(axis, str):
        raise TypeError(f"`Stacked` got `axis={axis!r}`; expected a mesh axis name (a str).")
    for name, value in (("microbatches", microbatches), ("repeats", repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TypeError(
                f"`Stacked` got `{name}={value!r}` with `axis={axis!r}`; expected a "
                f"positive int. A pipeline cuts each batch into `microbatches` pieces "
                f"(at least the number of stages keeps the bubble small)."
            )
    if mesh is not None and not isinstance(mesh, Mesh | AbstractMesh):
        raise TypeError(
            f"`Stacked` got `mesh` of type {type(mesh).__name__}; expected a "
            "`jax.sharding.Mesh` (or `None`, for the mesh set by `jax.set_mesh`)."
        )


class Stacked(eqx.Module):
    """A stack of `n` blocks run in order, `h = block_i(h)`, as one `jax.lax.scan`.

    `blocks` holds every layer at once: its array leaves share a leading layer dim `n`
    (the usual way to build it is `eqx.filter_vmap(make_block)(jax.random.split(key, n))`),
    its non-array leaves are shared by every layer. The scan compiles one layer, not `n`,
    so compile time does not grow with depth. `remat` picks what each layer keeps for the
    backward pass.

    With `axis` set, the stack is a pipeline whenever the mesh (`mesh`, or the one set by
    `jax.set_mesh`) has that axis: the layers are split into stages over `axis` and the
    batch into `microbatches` (see `filter_pipeline`); without such a mesh it is the plain
    scan, so the same model runs on one device. A pipeline needs the batch:

    - called on a batch (`h` with a leading batch dim), each block is called on a
        microbatch, so blocks must accept a batch;
    - called per example inside `jax.vmap`/`eqx.filter_vmap` (the Equinox way: the model
        written per example, batched from outside), a batching rule hands the pipeline
        the whole batch and each block runs per example under `vmap`. Differentiate
        outside the `vmap` (`jax.grad(lambda m: jax.vmap(m)(x).sum())`); per-example
        gradients (`jax.grad` inside `jax.vmap`) of a pipelined stack are refused.

    **Arguments:**

    - `blocks`: a PyTree whose array leaves share a leading layer dim; every slice
        `blocks[i]` is a callable block, `block(h) -> h`.
    - `remat`: what each layer keeps for the backward pass: `"none"` (default, keep
        everything), `"dots"` (keep matmul outputs, recompute the rest), `"full"` (keep
        only the layer's input) or `"offload"` (matmul outputs to host memory).
    - `axis`: the mesh axis to pipeline over, or `None` (default) for the plain scan.
    - `microbatches`: how many pieces each batch is cut into; required with `axis`.
    - `repeats`: `1` (default) for the GPipe schedule; `R > 1` for the circular one, each
        stage holding `R` chunks of layers.
    - `mesh`: the mesh to pipeline on; `None` uses the one set by `jax.set_mesh`.

    **Raises:**

    - `ValueError`: if `blocks` has no array leaves or its array leaves disagree on the
        leading dim (each listed by path); if `remat` is not a policy name; if
        `microbatches`, `repeats` or `mesh` are given without `axis`.
    - `TypeError`: if `axis` is not a str, `microbatches` or `repeats` not a positive int,
        or `mesh` not a mesh.

    Calling it raises what `filter_pipeline` raises when it pipelines, and a `ValueError`
    for a pipelined stack under `jax.grad` inside `jax.vmap`.

    !!! Example

        ```python
        keys = jax.random.split(jax.random.key(0), 6)
        blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(16, 16, key=k))(keys)
        stack = eqxshard.Stacked(blocks, remat="dots")
        h = stack(jnp.ones(16))  # the six layers, one after another
        hs = jax.vmap(stack)(jnp.ones((4, 16)))
        ```
    """

    blocks: Any
    remat: str = eqx.field(static=True)
    axis: str | None = eqx.field(static=True)
    microbatches: int | None = eqx.field(static=True)
    repeats: int = eqx.field(static=True)
    mesh: Mesh | AbstractMesh | None = eqx.field(static=True)

    def __init__(
        self,
        blocks: Any,
        *,
        remat: str | None = "none",
        axis: str | None = None,
        microbatches: int | None = None,
        repeats: int = 1,
        mesh: Mesh | AbstractMesh | None = None,
    ):
        layer_count(blocks, argname="blocks", verb="Stacked")
        # Without a mesh, "offload" is checked against the default device's memories.
        self.remat = check_remat("Stacked", remat, mesh or Mesh(jax.devices()[:1], ("layers",)))
        _check_pipeline(axis, microbatches, repeats, mesh)
        self.blocks = blocks
        self.axis, self.microbatches, self.repeats, self.mesh = axis, microbatches, repeats, mesh

    @property
    def n(self) -> int:
        """The number of layers: the leading dim of every array leaf of `blocks`."""
        return layer_count(self.blocks, argname="blocks", verb="Stacked")

    @classmethod
    def from_layers(cls, layers: Sequence[Any], **options: Any) -> Stacked:
        """A `Stacked` from a list of blocks of one structure: what turns a model's
        `for layer in self.layers: h = layer(h)` into `self.layers(h)`.

        Every block must have the same non-array leaves and the same array shapes and
        dtypes; the array leaves are stacked along a new leading dim. `options` are
        `Stacked`'s keywords (`remat`, `axis`, ...). `to_layers` is the inverse.

        **Raises:**

        - `ValueError`: if `layers` is empty, or its blocks differ in structure, in
            non-array leaves, or in array shapes or dtypes (each listed).
        """
        from .convert import stack_layers

        return cls(stack_layers(layers), **options)

    def to_layers(self) -> list[Any]:
        """The `n` blocks as a list, each block `i` holding slice `i` of every array leaf."""
        params, static = eqx.partition(self.blocks, eqx.is_array)
        return [
            eqx.combine(jax.tree.map(lambda x, i=i: x[i], params), static) for i in range(self.n)
        ]

    def _pipeline_mesh(self) -> Mesh | AbstractMesh | None:
        if self.axis is None:
            return None
        mesh = self.mesh if self.mesh is not None else _compat.ambient_mesh()
        return mesh if mesh is not None and self.axis in mesh.axis_names else None

    def __call__(self, h: Any) -> Any:
        mesh = self._pipeline_mesh()
        if mesh is None:
            return scan_layers(_apply, self.blocks, h, self.remat)
        params, static = eqx.partition(self.blocks, eqx.is_array)
        batching = batching_of(h)
        if batching == "innermost":

            def per_example(p: Any, x: Any) -> Any:
                return scan_layers(_apply, eqx.combine(p, static), x, self.remat)

            def on_batch(p: Any, xs: Any) -> Any:
                return self._pipeline(_apply_vmapped, eqx.combine(p, static), xs, mesh)

            return batched_call(per_example, on_batch, params, h)
        if batching == "beneath":
            raise ValueError(
                "`Stacked` is pipelined (`axis` is set and the mesh has it) and was called "
                "under `jax.grad` (or `jax.jvp`) inside `jax.vmap`: per-example gradients, "
                "where the pipeline cannot see the batch. Take the gradient outside the "
                "vmap (`jax.grad(lambda m: jax.vmap(m)(x).sum())`), or use a `Stacked` "
                "without `axis` for per-example gradients."
            )
        return self._pipeline(_apply, self.blocks, h, mesh)

    def _pipeline(self, layer: Callable[[Any, Any], Any], blocks: Any, h: Any, mesh: Any) -> Any:
        # Reached only with `axis` and `microbatches` set (`_pipeline_mesh` checks `axis`,
        # `__init__` requires `microbatches` with it).
        return filter_pipeline(
            layer,
            blocks,
            h,
            mesh=mesh,
            axis=cast(str, self.axis),
            microbatches=cast(int, self.microbatches),
            repeats=self.repeats,
            remat=self.remat,
        )


def _apply(block: Any, h: Any) -> Any:
    return block(h)


def _apply_vmapped(block: Any, h: Any) -> Any:
    return jax.vmap(block)(h)
