"""`pipeline_value_and_grad`: the MPMD pipeline, each stage its own compiled programs on its
own sub-mesh, driven from Python tick by tick.

- `value_and_grad`: `pipeline_value_and_grad` (checks, then the driver).
- `checks`: its own argument checks (beyond those shared with `filter_pipeline`).
- `driver`: runs the ticks, holds each microbatch's residuals from its forward to its
    backward, moves activations and cotangents between sub-meshes.
- `programs`: each stage's forward (`jax.vjp` of its layers) and backward, compiled once.
- `ticks`: the clock running the stages' orders against each other; the schedules by name.
- `one_f_one_b`: the 1F1B order (at most `S` microbatches' residuals per stage).
- `gpipe`: the GPipe order (every forward, then every backward).
- `submeshes`: each stage's sub-mesh, and a stack's piece on each (views, not copies).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement`, the shared modules of
`_pipeline` (`checks`, `remat`, `bubble`, `watch`) and this folder; never `spmd/` or
`stacked/`.
"""
