"""The training step: `filter_jit` with layouts (`in_shardings`/`out_shardings`) and
per-leaf donation, its compiled report, and a loop of steps.

- `jit`: `filter_jit`, the wrapper it returns (`JitWrapper`, its options `Config`), how a
  call runs (its cache, `lower`/`compile`), and the note on JAX's `ShardingTypeError`
  on Explicit axes.
- `entry`: what a call resolves once per static part and input signature (the `jax.jit`
  with its shardings and donated arguments), and laying inputs out at each call.
- `leaves`: a call's leaves split into arrays and the static part, the cache key.
- `layouts`: `in_shardings`/`out_shardings` in every form `filter_shard`'s
  `target`/`spec` take, read into one sharding per leaf; moving or checking inputs.
- `donate`: which array leaves are donated (`donate=`).
- `describe_step`: `describe_step` and the `StepReport` it returns.
- `pinned`: the ops a compiled step runs on one device and replicates (`auto_plan`
  reads them too).
- `loop`: `StepLoop`, many calls of one step with the state kept flat.

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement` and this folder (rules
are read as `filter_shard` reads them, by their `spec_for`, so that `_plans` may build on
`filter_jit`: a `Plan`'s `jit`).
"""
