"""eqxshard: sharding for Equinox models and other JAX PyTrees."""

from . import _version, links as links, report as report, rules as rules
from ._caches import clear_caches as clear_caches
from ._checkpoint.async_save import AsyncSave as AsyncSave
from ._checkpoint.restore import filter_restore as filter_restore
from ._checkpoint.save import filter_save as filter_save, latest_step as latest_step
from ._deprecated import __getattr__ as __getattr__
from ._experts.module import Experts as Experts
from ._experts.moe import moe as moe
from ._mapping.jacobian import (
    filter_hessian as filter_hessian,
    filter_jacfwd as filter_jacfwd,
    filter_jacrev as filter_jacrev,
)
from ._mapping.map import filter_map as filter_map
from ._mapping.stream import filter_stream as filter_stream
from ._pipeline.mpmd.value_and_grad import pipeline_value_and_grad as pipeline_value_and_grad
from ._pipeline.spmd.pipeline import filter_pipeline as filter_pipeline
from ._pipeline.stacked.stacked import Stacked as Stacked
from ._placement.get import filter_get as filter_get
from ._placement.put import filter_put as filter_put
from ._placement.shard import filter_replicate as filter_replicate, filter_shard as filter_shard
from ._plans.auto.candidate import NothingFits as NothingFits
from ._plans.auto.result import Plan as Plan
from ._plans.auto.search import auto_plan as auto_plan
from ._plans.describe import describe as describe
from ._plans.experts import experts as experts
from ._plans.fsdp import fsdp as fsdp
from ._plans.like import like as like
from ._plans.logical import logical as logical
from ._plans.path_rules import path_rules as path_rules
from ._plans.pipeline_choice import Pipeline as Pipeline
from ._plans.plan import filter_init as filter_init, filter_shardings as filter_shardings
from ._plans.rules import first as first
from ._plans.stages import stages as stages
from ._processes.initialize import initialize as initialize
from ._processes.setup_check import check_setup as check_setup
from ._sequence.attention import context_attention as context_attention
from ._sequence.parallel import context_parallel as context_parallel
from ._shard_map.shard_map import filter_shard_map as filter_shard_map
from ._step.describe_step import describe_step as describe_step
from ._step.jit import filter_jit as filter_jit
from ._step.loop import StepLoop as StepLoop
from ._tree import FallbackWarning as FallbackWarning

__version__ = _version.version()
