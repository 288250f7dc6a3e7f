"""`filter_pipeline`: one jitted program (a `shard_map` over the stage axis) in which each
stage runs its own layers on one microbatch per tick and passes activations on by
collective permutes.

- `pipeline`: `filter_pipeline` and `run_pipeline` (also for a stack stored stage-major,
    as `Stacked` runs it): checks, layout over the stage axis, microbatches, `shard_map`.
- `schedule`: the per-stage loop, tick by tick (GPipe for `repeats=1`, circular for more).
- `stage_major`: which chunks of layers each stage holds in the circular schedule, the
    stage-major order a stack is stored in for it (`to_stage_major`, `from_stage_major`),
    the all-to-all reaching it inside the step (`regroup`), and the warning for a `Stacked`
    that pays that every step.

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement`, `eqxshard._shard_map`,
the shared modules of `_pipeline` (`checks`, `remat`, `bubble`, `watch`) and this folder;
never `mpmd/` or `stacked/`.
"""
