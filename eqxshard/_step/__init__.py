"""The training step: `filter_jit` with layouts (`in_shardings`/`out_shardings`) and
per-leaf donation.

Owns `filter_jit` (`jit`: the public function; `call`: the wrapper, its cache and the
call; `static`: the static part of a call as the cache key; `layouts`: reading
`in_shardings`/`out_shardings` in every form `filter_shard`'s `target`/`spec` take into
one sharding per leaf, and moving or checking inputs; `donate`: which array leaves are
donated; `sharding_note`: the note on JAX's `ShardingTypeError` on Explicit axes; `leaves`:
a call's leaves split into arrays and the static part; `entry`: what a call resolves once
per static part and signature, and laying inputs out), `describe_step` (its `StepReport`
in `step_report`): a step's compiled layouts and work; `pinned`: the ops a compiled step
runs on one device and replicates (`auto_plan` reads them too); and `StepLoop` (`loop`:
many calls of one step with the state kept flat).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement` and this folder (rules
are read as `filter_shard` reads them, by their `spec_for`, so that `_plans` may build on
`filter_jit`: a `Plan`'s `jit`).
"""
