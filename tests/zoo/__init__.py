"""A zoo of small Equinox models, written for eqxshard's tests (`tests/test_zoo.py`).

Each uses parts of `eqx.nn` that real models are made of and that a layout can break:
lookups (`Embedding`), convolutions, attention with rotary embeddings, a weight tied
through `eqx.nn.Shared`, a stack of layers built by `eqx.filter_vmap` and run by
`jax.lax.scan`, `eqx.nn.State` (`BatchNorm`), and a PRNG key (dropout). Sizes are tiny,
but every dim the rules split divides 8.
"""
