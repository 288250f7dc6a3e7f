"""Mapping: running a function over a batch (or a basis) in chunks.

- `map`: `filter_map`, its wrapper, and the `lax.scan` over chunks that runs it.
- `stream`: `filter_stream`, `filter_map` for inputs on the host, and its compiled
  chunk step; `stream_host`: moving chunks between host and devices.
- `chunks`: the checks the maps share (`batch_size`, `in_axes`/`out_axes`, the mapped
  leaves) and the `vmap` of one chunk (`vmapped_body`).
- `axis_name`: `filter_map`'s `axis_name`, and refusing collectives over it.
- `jacobian`: `filter_jacrev`, `filter_jacfwd`, `filter_hessian` and their chunked
  program; `basis`: the basis vectors pushed; `jacobian_dtypes`: the result's dtypes;
  `shared`: the programs one function's Jacobians share across calls.
- `budget`: `batch_size="auto"`; `programs`: compiled programs keyed as
  `eqx.filter_jit` keys them.

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement` and this folder;
never `_shard_map` (a sibling) or anything above.
"""
