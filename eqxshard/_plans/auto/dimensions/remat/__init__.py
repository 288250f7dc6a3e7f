"""The remat dimension: remat policies for the model's `Stacked` layers.

- `dimension`: `Remat`, the dimension (it refines measured rows).
- `policies`: which variants are worth compiling, and what each row says.
- `residuals`: what each policy keeps and recomputes, from the step's jaxpr.
- `per_stack`: rematerialising some stacks only, the fewest that fit.
"""
