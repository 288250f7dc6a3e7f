"""Long sequences: attention with the sequence dim split over a mesh axis (context
parallelism).

Owns `context_attention` (`attention`: the verb, run in `jax.shard_map` over the context
axis) and the pieces it runs in order:

- `checks`: the argument checks, run before anything is traced, and the `Problem` record
  of shapes and options they hand on;
- `blocks`: one block of queries against one block of keys (scores, the mask of what a
  query may see, the online-softmax update in float32 and its gradients);
- `gather`: the `"all_gather"` strategy (every key and value gathered);
- `ring`: the `"ring"` strategy (key/value blocks passed round by `ppermute`, its own
  backward pass going round again), with `zigzag`: the causal layout that balances work.
- `ulysses`: the `"all_to_all"` strategy (heads and sequence exchanged);
- `parallel`: `context_parallel`, a model's `eqx.nn.MultiheadAttention` layers swapped for
  a subclass (same fields, same call) whose core is `context_attention`.

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement` and this folder;
never a sibling on its layer (`_mapping`, `_shard_map`, `_step`) or anything above.
"""
