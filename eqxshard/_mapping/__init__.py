"""Mapping: running a function over a batch (or a basis) in chunks.

Owns `filter_map` (`map`), `filter_stream` (`stream`, `stream_host`, `stream_step`), the
chunked Jacobians (`jacobian`, `basis`), the checks they share (`chunks`, `axis_name`)
and `batch_size="auto"` (`budget`).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement` and this folder;
never `_shard_map` (a sibling) or anything above.
"""
