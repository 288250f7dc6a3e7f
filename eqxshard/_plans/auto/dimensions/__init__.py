"""The parallelism dimensions the search weighs, each one module behind `base.Dimension`.

- `base`: `Dimension` (the interface), and the records `Proposal`, `Measured`, `Search`.
- `registry`: `DIMENSIONS`, the dimensions in the order the search asks them.
- `propose`, `refine`: the two phases that ask every dimension.
- `data_fsdp_tensor`: mesh factorisations (data x fsdp x model) and rule families;
  `tensor_parallel`: the TP rule from the model's shapes.
- `stage/`: a pipeline's stage axis.
- `offload`: the optimiser state in pinned host memory.
- `remat/`: remat policies for the model's `Stacked` layers.
- `context`: the sequence split over a `context` axis (`context_parallel`), weighed as a
  refinement of the measured layouts.
- `experts`: the `Experts` of a model split over an `expert` axis (expert parallelism),
  weighed as a refinement too.

A new dimension is a module with a `Dimension` subclass and a line in `registry`.
"""
