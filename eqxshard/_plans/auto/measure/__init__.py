"""The measure phase: each proposed layout laid out, compiled and read.

- `phase`: `measure`, the phase.
- `jobs`: a layout laid out on its mesh (`laid_out`), compiled here or elsewhere.
- `compiled`: the step as a candidate compiles it, and its `Measurement`.
- `collectives`, `host_memory`: figures read from the compiled HLO.
- `batch_proxies`: batches drawn through the compiles of two smaller ones.
- `compile_remote`, `compile_worker`: compiles in a subprocess with more CPU devices.
- `cache`: compiled results, by key.
"""
