"""The dimensions the search weighs, in the order it asks them (see `base.Dimension`).

The order matters where one dimension reads another's rows: the stage meshes are
proposed after the data/fsdp/tensor layouts (the scale phase weighs stage meshes above
`compile_limit` against the fastest of those); offload refines the measured rows before
remat does (remat's variants still over budget are then offered offload too). A new
dimension is a module with a `Dimension` subclass, and one line here.
"""

from __future__ import annotations

from .base import Dimension
from .context import Context
from .data_fsdp_tensor import DataFsdpTensor
from .offload import Offload
from .remat.dimension import Remat
from .stage.dimension import Stage

DIMENSIONS: tuple[Dimension, ...] = (DataFsdpTensor(), Stage(), Offload(), Remat(), Context())
