"""`Stacked`: the module holding a stack of blocks with a leading layer dim, run by one
`jax.lax.scan` or, with a stage axis, by `filter_pipeline`'s schedules.

- `stacked`: `Stacked` itself (its call: the scan, the pipeline, per example under `vmap`).
- `options`: its pipeline options checked, and the stage count it is stored stage-major for.
- `scan`: the plain scan over the layers, and the layer count a stack's leaves share.
- `batching`: the batching rule that hands a pipelined stack the whole batch under `vmap`.
- `keys`: a PRNG key per layer for blocks that take `key=`.
- `convert`: a list of blocks stacked into one (`Stacked.from_layers`).
- `building`: building stacks with a mesh set, so a circular one is stored stage-major
    (`filter_init`, `Plan.apply`).
- `configure`: a model's stacks found by path and rebuilt with a plan's remat and
    pipeline choices (`Plan.apply`, `auto_plan`).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement`, the shared modules of
`_pipeline` (`checks`, `remat`, `bubble`, `watch`), `spmd/` (the pipeline and the
stage-major order) and this folder; never `mpmd/`.
"""
