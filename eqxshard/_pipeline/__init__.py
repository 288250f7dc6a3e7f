"""Pipelines: layer stacks run as one scan, or pipelined over a mesh axis.

Owns `Stacked` (`stacked`: a module holding a stack of blocks with a leading layer dim,
run by one `jax.lax.scan`), the named rematerialisation policies (`remat`, shared by every
verb here that runs layers) and the batching rule that lets a pipelined stack see the
whole batch under `jax.vmap` (`batching`).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement`, `eqxshard._mapping`,
`eqxshard._shard_map` and this folder.
"""
