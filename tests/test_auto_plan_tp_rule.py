"""`auto_plan`'s tensor-parallel rule gives each weight its own spec whatever its path ends
with: a pattern for one path never takes a longer path that ends the same way."""

from __future__ import annotations

import equinox as eqx
import jax
from jax.sharding import AxisType, PartitionSpec as P

import eqxshard
from eqxshard._plans.auto.dimensions.tensor_parallel import (
    tensor_parallel_roles,
    tensor_parallel_rule,
)


class Inner(eqx.Module):
    linear: eqx.nn.Linear  # 64 -> 16: an out-projection, split on its input dim

    def __init__(self, key):
        self.linear = eqx.nn.Linear(64, 16, key=key)


class Outer(eqx.Module):
    linear: eqx.nn.Linear  # 16 -> 64: an in-projection, split on its output dim
    inner: Inner  # `inner.linear.weight` ends as `linear.weight` does

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear = eqx.nn.Linear(16, 64, key=k1)
        self.inner = Inner(k2)


def test_a_pattern_does_not_take_a_longer_path_that_ends_the_same_way():
    model = eqx.filter_eval_shape(Outer, jax.random.key(0))
    roles = tensor_parallel_roles(model)
    assert roles["linear.weight"].kind == "in" and roles["inner.linear.weight"].kind == "out"
    built = tensor_parallel_rule(model, roles, {"model": 2})
    assert built is not None
    rule, skipped = built
    assert skipped == []
    mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Auto,))
    plan = eqxshard.filter_shardings(model, mesh, rule)
    assert plan.linear.weight.spec == P("model", None)
    assert plan.linear.bias.spec == P("model")
    assert plan.inner.linear.weight.spec == P(None, "model")
    assert plan.inner.linear.bias.spec == P()
    # The optimiser state's copies (`mu.linear.weight`, ...) are laid out as the model.
    state = {"mu": model}
    placed = eqxshard.filter_shardings(state, mesh, rule)
    assert placed["mu"].inner.linear.weight.spec == P(None, "model")
    assert placed["mu"].linear.weight.spec == P("model", None)
    # The rule reads back as Python and gives the same layout.
    again = eval(repr(rule), {"path_rules": eqxshard.path_rules, "P": P})
    assert eqxshard.filter_shardings(model, mesh, again).inner.linear.weight.spec == P(
        None, "model"
    )
