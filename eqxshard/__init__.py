"""eqxshard: sharding for Equinox models and other JAX PyTrees."""

import importlib.metadata

from ._get import filter_get as filter_get
from ._put import filter_put as filter_put
from ._shard import filter_replicate as filter_replicate, filter_shard as filter_shard

__version__ = importlib.metadata.version("eqxshard")
