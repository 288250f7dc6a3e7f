"""`Stacked`: a stack of blocks with a leading layer dim, run by one `jax.lax.scan`."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from ... import _compat
from ..._tree import FallbackWarning, did_you_mean
from ..remat import check_remat
from ..spmd.pipeline import run_pipeline
from ..spmd.stage_major import from_stage_major, to_stage_major
from .batching import batched_call, batching_of
from .keys import key_parts, keyed_forms, microbatch_keys, takes_key
from .options import check_options, stored_stages
from .scan import layer_count, scan_layers, whole_layer_dim


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
    scan, so the same model runs on one device. On a mesh without `axis` it is the plain
    scan too, with a `FallbackWarning` naming the mesh's axes (the result is the same, but
    the pipeline asked for is off: a warning, not an error). A pipeline needs the batch:

    - called on a batch (`h` with a leading batch dim), each block is called on a
        microbatch, so blocks must accept a batch;
    - called per example inside `jax.vmap`/`eqx.filter_vmap` (the Equinox way: the model
        written per example, batched from outside), a batching rule hands the pipeline
        the whole batch and each block runs per example under `vmap`. Differentiate
        outside the `vmap` (`jax.grad(lambda m: jax.vmap(m)(x).sum())`); per-example
        gradients (`jax.grad` inside `jax.vmap`) of a pipelined stack are refused, and so
        is a pipelined stack reached through `jax.checkpoint`, `jax.jit` or a `lax.scan`
        body inside the `vmap` (it would see one example): apply those outside the `vmap`.
        Nested `vmap`s pipeline the innermost batch.

    `stack(h, key=key)` splits `key` into one key per layer (`jax.random.split(key, n)[i]`
    for layer `i`) and passes it as `key=` to blocks that take one (dropout), the same
    under the plain scan, every `remat` and the pipeline per example; a key per example
    under `jax.vmap` works too. Called on a batch, the pipeline gives microbatch `m`
    (rows `m, m+M, ..`) the layer keys of `jax.random.fold_in(key, m)` instead, as it
    never runs the whole batch at once. Numbers in the blocks (non-array leaves, which
    `jax.jit` turns into 0-d arrays) are shared by every layer.

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

    A circular stack (`repeats > 1`) whose stage count is known when it is built (from
    `mesh`, or the mesh set by `jax.set_mesh` then) is stored **stage-major**: the
    `blocks` attribute holds stage `s`'s chunks (layer chunks `s, s+S, ..`) next to each
    other, so that the `stages` rule's contiguous split gives each stage the chunks the
    circular schedule runs on it and no weights move per step. `stages` records that
    stage count (`None`: layer order; a circular stack stored so is regrouped by an
    all-to-all per step, with a warning; `filter_init` and `Plan.apply` build it with
    their mesh set). `to_layers()` and `n` read the layers in layer order. A
    checkpoint names a stage-major stack's leaves with its order
    (`blocks.stage_major_4x2.…`), so it restores only into a `Stacked` stored the same
    way; a restore into another order is an error naming the leaves, never layers loaded
    in the wrong order (restore into the saved order, then
    `Stacked.from_layers(stack.to_layers(), ...)`).

    **Raises:**

    - `ValueError`: if `blocks` has no array leaves or its array leaves disagree on the
        leading dim (each listed by path); if `remat` is not a policy name; if
        `microbatches`, `repeats` or `mesh` are given without `axis`; if a stack stored
        stage-major does not split into stages x `repeats` chunks.
    - `TypeError`: if `axis` is not a str, `microbatches` or `repeats` not a positive int,
        or `mesh` not a mesh.

    Calling it raises what `filter_pipeline` raises when it pipelines, and a `ValueError`
    for a pipelined stack under `jax.grad` inside `jax.vmap` or reached through a
    transformation that traces it on its own inside `jax.vmap`, or one stored stage-major
    for another stage count than the mesh's.

    !!! Example

        ```python
        keys = jax.random.split(jax.random.key(0), 6)
        blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(16, 16, key=k))(keys)
        stack = eqxshard.Stacked(blocks, remat="dots")
        h = stack(jnp.ones(16))  # the six layers, one after another
        hs = jax.vmap(stack)(jnp.ones((4, 16)))
        h = stack(jnp.ones(16), key=jax.random.key(1))  # a key per layer, for blocks that take one
        ```
    """

    blocks: Any
    remat: str = eqx.field(static=True)
    axis: str | None = eqx.field(static=True)
    microbatches: int | None = eqx.field(static=True)
    repeats: int = eqx.field(static=True)
    mesh: Mesh | AbstractMesh | None = eqx.field(static=True)
    stages: int | None = eqx.field(static=True)

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
        n = layer_count(blocks, argname="blocks", verb="Stacked")
        # Without a mesh, "offload" is checked against the default device's memories.
        self.remat = check_remat("Stacked", remat, mesh or Mesh(jax.devices()[:1], ("layers",)))
        check_options(axis, microbatches, repeats, mesh)
        self.axis, self.microbatches, self.repeats, self.mesh = axis, microbatches, repeats, mesh
        self.stages = stored_stages(axis, repeats, mesh)
        if self.stages is not None:
            if n % (self.stages * repeats):
                raise ValueError(
                    f"`Stacked` cannot store {n} layers stage-major in {self.stages} stages "
                    f"(of mesh axis {axis!r}) x repeats={repeats} = "
                    f"{self.stages * repeats} equal chunks. Use a layer count divisible by "
                    f"{self.stages * repeats}, or change `repeats` or the stage axis's size."
                )
            blocks = to_stage_major(blocks, self.stages, repeats)
        self.blocks = blocks

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
        `Stacked`'s keywords (`remat`, `axis`, ...). `to_layers` is the inverse. To swap
        a model's list of blocks for a stack in one step, `eqx.tree_at(lambda m:
        m.blocks, model, Stacked.from_layers(model.blocks))`; `filter_restore` reads a
        checkpoint of the list form into the stacked model (see docs/pipelines.md).

        **Raises:**

        - `ValueError`: if `layers` is empty, or its blocks differ in structure, in
            non-array leaves (static fields included), or in array shapes or dtypes:
            each difference by its path, e.g. `layers.3.up.weight  float32(64, 32)
            layers.0 has float32(32, 32)`, or `layers.2.act  relu  layers.0 has gelu`.
        """
        from .convert import stack_layers

        return cls(stack_layers(layers), **options)

    def to_layers(self) -> list[Any]:
        """The `n` blocks as a list, in layer order (also of a stack stored stage-major)."""
        params, static = eqx.partition(self.blocks, eqx.is_array)
        params = jax.tree.map(whole_layer_dim, params)
        if self.stages is not None:
            params = from_stage_major(params, self.stages, self.repeats)
        return [
            eqx.combine(jax.tree.map(lambda x, i=i: x[i], params), static) for i in range(self.n)
        ]

    def __iter__(self) -> Any:
        """Refused with the one-line fix: a model that looped over a list of blocks
        (`for block in self.blocks: h = block(h)`) calls its stack once instead."""
        raise TypeError(
            "A `Stacked` is not iterated: it runs its layers itself, as one scan (or a "
            "pipeline). Replace `for block in self.blocks: h = block(h)` with "
            "`h = self.blocks(h)` (`h = self.blocks(h, key=key)` for blocks that take a "
            "key); `stack.to_layers()` gives the blocks as a list."
        )

    def _pipeline_mesh(self) -> Mesh | AbstractMesh | None:
        if self.axis is None:
            return None
        mesh = self.mesh if self.mesh is not None else _compat.ambient_mesh()
        if mesh is None:
            return None  # no mesh at all: the same model on one device, as documented
        if self.axis not in mesh.axis_names:
            warnings.warn(
                f"`Stacked(axis={self.axis!r})` runs as the plain scan, not a pipeline: its "
                f"mesh has no axis {self.axis!r}, only {tuple(mesh.axis_names)}."
                f"{did_you_mean(self.axis, mesh.axis_names)} Pass `axis=` the mesh's stage "
                "axis (or add that axis to the mesh) to pipeline; `axis=None` for the plain "
                "scan without this warning.",
                FallbackWarning,
                stacklevel=3,
            )
            return None
        return mesh

    def _order(self) -> tuple[int, int] | None:
        return None if self.stages is None else (self.stages, self.repeats)

    def __call__(self, h: Any, *, key: Any = None) -> Any:
        """Runs the layers in order on `h`; `key` (optional) is split into one key per layer,
        `jax.random.split(key, n)[i]` for layer `i`, passed as `key=` to blocks that take
        one, the same under the plain scan, any `remat` and the pipeline."""
        mesh = self._pipeline_mesh()
        if mesh is not None:
            stages = dict(mesh.shape)[cast(str, self.axis)]
            if self.stages is not None and stages != self.stages:
                raise ValueError(
                    f"This `Stacked` stores its layers stage-major for {self.stages} stages, "
                    f"but its mesh has {stages} along {self.axis!r}. Rebuild it for this "
                    "mesh: `Stacked.from_layers(stack.to_layers(), axis=..., "
                    "microbatches=..., repeats=..., mesh=mesh)` (under `jax.set_mesh(mesh)` "
                    "without `mesh`)."
                )
        # A 0-d array leaf (a number of the block's, which `jax.jit` made a tracer) is
        # shared by every layer, as the non-array leaf it was when the stack was built.
        number = lambda a: eqx.is_array(a) and not a.ndim  # noqa: E731
        blocks = eqx.filter(self.blocks, number, inverse=True)
        shared = eqx.filter(self.blocks, number)
        keyed = key is not None and takes_key(self.blocks)
        fill = lambda f: _filled(f, shared, keyed) if jax.tree.leaves(shared) else f  # noqa: E731
        if not keyed:
            return self._run(tuple(map(fill, _PLAIN)), blocks, h, mesh)
        n = layer_count(blocks, argname="blocks", verb="Stacked")
        index = jnp.arange(n)  # each layer's index travels with its weights
        if self.stages is not None:
            index = to_stage_major(index, self.stages, self.repeats)
        data, wrap = key_parts(key)
        forms = tuple(map(fill, keyed_forms(wrap, n)))
        if mesh is not None and batching_of((h, data)) == "none":
            # The pipeline on the caller's batch: each microbatch a key of its own.
            batch = [a.shape[0] for a in jax.tree.leaves(h) if getattr(a, "ndim", 0)]
            if batch:
                data = microbatch_keys(key, batch[0], cast(int, self.microbatches))
        return self._run(forms, (blocks, index), (h, data), mesh)[0]

    def _run(self, forms: tuple[Any, Any, Any], blocks: Any, h: Any, mesh: Any) -> Any:
        one, rows, vmapped = forms
        if mesh is None:
            return scan_layers(one, blocks, h, self.remat, self._order())
        params, static = eqx.partition(blocks, eqx.is_array)
        batching = batching_of(h)
        if batching == "innermost":

            def per_example(p: Any, x: Any) -> Any:
                return scan_layers(one, eqx.combine(p, static), x, self.remat, self._order())

            def on_batch(p: Any, xs: Any) -> Any:
                return self._pipeline(vmapped, eqx.combine(p, static), xs, mesh)

            return batched_call(per_example, on_batch, params, h)
        if batching == "beneath":
            raise ValueError(
                "`Stacked` is pipelined (`axis` is set and the mesh has it) and was called "
                "under `jax.grad` (or `jax.jvp`) inside `jax.vmap`: per-example gradients, "
                "where the pipeline cannot see the batch. Take the gradient outside the "
                "vmap (`jax.grad(lambda m: jax.vmap(m)(x).sum())`), or use a `Stacked` "
                "without `axis` for per-example gradients."
            )
        if batching == "staged":
            raise ValueError(
                "`Stacked` is pipelined (`axis` is set and the mesh has it) and was reached "
                "through a transformation that traces it on its own (`jax.checkpoint` / "
                "`eqx.filter_checkpoint`, `jax.jit`, a `lax.scan` or `lax.cond` body, ...) "
                "inside `jax.vmap`: it sees one example, and the pipeline needs the whole "
                "batch. Apply that transformation outside the vmap (e.g. "
                "`eqx.filter_checkpoint(jax.vmap(model))(x)`, `jax.jit(jax.vmap(model))`), "
                "or use `Stacked(remat=...)` for rematerialisation."
            )
        return self._pipeline(rows, blocks, h, mesh)

    def _pipeline(self, layer: Callable[[Any, Any], Any], blocks: Any, h: Any, mesh: Any) -> Any:
        # Reached only with `axis` and `microbatches` set (`_pipeline_mesh` checks `axis`,
        # `__init__` requires `microbatches` with it).
        return run_pipeline(
            "Stacked",
            layer,
            blocks,
            h,
            mesh=mesh,
            axis=cast(str, self.axis),
            microbatches=cast(int, self.microbatches),
            repeats=self.repeats,
            remat=self.remat,
            stage_major=self.stages is not None,
        )


def _filled(form: Callable[[Any, Any], Any], shared: Any, keyed: bool) -> Any:
    """`form` given each layer's block with the leaves every layer shares put back."""

    def layer(block: Any, h: Any) -> Any:
        if keyed:
            block, i = block
            return form((eqx.combine(block, shared), i), h)
        return form(eqx.combine(block, shared), h)

    return layer


def _apply(block: Any, h: Any) -> Any:
    return block(h)


def _apply_vmapped(block: Any, h: Any) -> Any:
    return jax.vmap(block)(h)


# The layer as the plain scan (and a per-example call) runs it, as the pipeline runs it on
# the caller's microbatches, and per example under `vmap`.
_PLAIN = (_apply, _apply, _apply_vmapped)


def is_stacked(x: Any) -> bool:
    """Whether `x` is a `Stacked` (an `is_leaf` that stops at stacks)."""
    return isinstance(x, Stacked)
