"""The search's first phase: `auto_plan`'s arguments checked and the step traced.

- `phase`: `trace`, the phase, and its record `Traced`.
- `arguments`: devices, budget and options checked; the step traced once.
- `problem`: `Problem`, what `auto_plan` was given, as shapes.
- `own_pipeline`: the pipeline of a step that calls `filter_pipeline` itself.
- `flops`: the step's matmul flops, from its jaxpr.
"""
