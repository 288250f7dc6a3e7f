"""The training step: `filter_jit` with layouts (`in_shardings`/`out_shardings`) and
per-leaf donation.

Owns `filter_jit` (`jit`: the public function; `call`: the wrapper, its cache and the
call; `static`: the static part of a call as the cache key; `layouts`: reading
`in_shardings`/`out_shardings` in every form `filter_shard`'s `target`/`spec` take into
one sharding per leaf, and moving or checking inputs; `donate`: which array leaves are
donated; `sharding_note`: the note on JAX's `ShardingTypeError` on Explicit axes) and
`describe_step` (its `StepReport` in `step_report`): a step's compiled layouts and work.

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement`, `eqxshard._mapping`,
`eqxshard._shard_map`, `eqxshard._pipeline`, `eqxshard._plans` and this folder.
"""
