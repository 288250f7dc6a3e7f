"""eqxshard: sharding for Equinox models and other JAX PyTrees."""

import importlib.metadata

from ._checkpoint import (
    AsyncSave as AsyncSave,
    filter_save as filter_save,
    latest_step as latest_step,
)
from ._describe import LeafRow as LeafRow, ShardingTable as ShardingTable, describe as describe
from ._fsdp import fsdp as fsdp
from ._get import filter_get as filter_get
from ._initialize import initialize as initialize
from ._jacobian import (
    filter_hessian as filter_hessian,
    filter_jacfwd as filter_jacfwd,
    filter_jacrev as filter_jacrev,
)
from ._like import like as like
from ._logical import logical as logical
from ._map import filter_map as filter_map
from ._plan import filter_init as filter_init, filter_plan as filter_plan
from ._put import filter_put as filter_put
from ._restore import filter_restore as filter_restore
from ._rules import (
    NO_MATCH as NO_MATCH,
    Rule as Rule,
    dotted_path as dotted_path,
    first as first,
    path_rules as path_rules,
)
from ._setup import SetupReport as SetupReport, check_setup as check_setup
from ._shard import filter_replicate as filter_replicate, filter_shard as filter_shard
from ._shard_map import filter_shard_map as filter_shard_map
from ._stream import filter_stream as filter_stream

__version__ = importlib.metadata.version("eqxshard")
