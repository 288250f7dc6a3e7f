"""One process of the multi-host run of `test_plan_multihost.py`: 2 processes x 4 CPU devices.

    python plan_worker.py PORT PROCESS_ID NUM_PROCESSES

Joins the run (`jax.distributed.initialize`, gloo collectives on 127.0.0.1), runs every
scenario below in order and prints one JSON line per scenario:
`{"scenario": name, "process": id, "ok": bool, "error": traceback or null}`.
Each scenario checks, on its own process, the shards its process holds.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from worker_common import LOCAL_DEVICES, check, join, run_scenarios

import eqxshard
from eqxshard import describe, filter_init, filter_shardings, fsdp, like, path_rules

SCENARIOS: dict[str, Callable[[int], None]] = {}


def scenario(fn: Callable[[int], None]) -> Callable[[int], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


def make_model(key: jax.Array) -> eqx.nn.MLP:
    return eqx.nn.MLP(16, 8, 32, 2, key=key)


def global_mesh(kind: AxisType) -> Any:
    return jax.make_mesh((8,), ("data",), axis_types=(kind,))


def check_local_shards(placed: Any, expected: Any) -> None:
    """Every array leaf holds, on each local device, exactly its slice of `expected`."""
    for x, want in zip(jax.tree.leaves(placed), jax.tree.leaves(expected), strict=True):
        if not eqx.is_array(want):
            continue
        check(x.shape == want.shape, f"shape {x.shape} != {want.shape}")
        check(not x.is_fully_addressable, f"{x.sharding} is not global")
        shards = x.addressable_shards
        check(len(shards) == LOCAL_DEVICES, f"{len(shards)} local shards")
        for shard in shards:
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want)[shard.index])


@scenario
def init_fsdp_holds_only_local_shards(process: int) -> None:
    for kind in (AxisType.Auto, AxisType.Explicit):
        mesh = global_mesh(kind)
        rule = fsdp("data", min_size=0)
        model = filter_init(make_model, mesh, rule)(jax.random.key(0))
        weight = model.layers[1].weight
        want = NamedSharding(mesh, P("data"))
        check(weight.sharding.is_equivalent_to(want, 2), str(weight.sharding))
        check(model.activation is jax.nn.relu, "statics rebuilt")
        check_local_shards(model, make_model(jax.random.key(0)))


@scenario
def init_optimizer_state_like_params(process: int) -> None:
    mesh = global_mesh(AxisType.Explicit)
    model = filter_init(make_model, mesh, fsdp("data", min_size=0))(jax.random.key(0))
    params = eqx.filter(model, eqx.is_array)
    state = filter_init(optax.adam(1e-3).init, mesh, like(params))(params)
    state = cast(tuple[Any, ...], state)  # optax types a state as an `ArrayTree`: it is a tuple
    mu = state[0].mu.layers[0].weight
    check(mu.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2), str(mu.sharding))
    check(state[0].count.sharding.is_fully_replicated, str(state[0].count.sharding))
    expected = optax.adam(1e-3).init(eqx.filter(make_model(jax.random.key(0)), eqx.is_array))
    check_local_shards(state, expected)


@scenario
def plan_and_describe_count_every_device(process: int) -> None:
    mesh = global_mesh(AxisType.Auto)
    abstract = eqx.filter_eval_shape(make_model, jax.random.key(0))
    plan = filter_shardings(abstract, mesh, fsdp("data", min_size=0))
    check(plan.layers[0].weight.spec == P("data"), str(plan.layers[0].weight))
    table = describe(abstract, mesh, fsdp("data", min_size=0))
    check(len(table.bytes_per_device) == 8, f"{len(table.bytes_per_device)} devices")
    check(table.max_bytes_per_device * 8 == table.total_bytes, str(table))


@scenario
def shard_with_path_rules(process: int) -> None:
    mesh = global_mesh(AxisType.Auto)
    model = make_model(jax.random.key(0))
    rules = path_rules([(r"layers\.\d\.weight", P("data")), (r".*", P())])
    placed = eqxshard.filter_shard(model, mesh, rules)
    weight = placed.layers[0].weight
    check(weight.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2), "weight split")
    bias = placed.layers[0].bias
    check(bias is not None and bias.sharding.is_fully_replicated, "bias replicated")
    check_local_shards(placed, model)


def main() -> None:
    process, _ = join(sys.argv)
    run_scenarios(SCENARIOS, process)


if __name__ == "__main__":
    main()
