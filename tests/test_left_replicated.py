"""What rules could not place: `like` of a tree with no array leaves, and `describe`'s
summary of the leaves a rule left replicated and why (eqxshard/_plans/describe.py,
fsdp.py, like.py)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import make_mesh
from jax.sharding import PartitionSpec as P

import eqxshard
from eqxshard import describe, first, fsdp, like, path_rules


def mlp() -> eqx.nn.MLP:
    return eqx.nn.MLP(64, 64, 256, 2, key=jax.random.key(0))


def test_like_of_a_tree_with_no_arrays_raises_and_names_the_filter() -> None:
    abstract = eqx.filter_eval_shape(mlp)
    with pytest.raises(ValueError, match=r"`like` got `params` with no array leaves \(MLP") as e:
        like(eqx.filter(abstract, eqx.is_array))
    assert "`eqx.filter(abstract, eqx.is_array)` drops every `jax.ShapeDtypeStruct`" in str(e.value)
    with pytest.raises(ValueError, match=r"\(dict with 2 leaves, none an array \(int, str\)\)"):
        like({"a": 1, "b": "x"})
    # The abstract tree itself, with a plan, is what to pass.
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    rule = like(abstract, plan=eqxshard.filter_shardings(abstract, mesh, fsdp("data")))
    assert repr(rule) == "like(<6 parameters>)"


def test_describe_says_what_fsdp_left_replicated_and_why() -> None:
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    table = describe(mlp(), mesh, fsdp("data"))
    reason = "fsdp(axis='data', min_size=16384): fewer than `min_size` elements"
    assert table.left_replicated == {reason: (3, (256 + 256 + 64) * 4)}
    text = str(table)
    assert f"Left replicated by the rules: 3 leaves (2.2 KiB): 3 (2.2 KiB) by {reason}." in text
    assert "Left replicated by the rules" in table._repr_html_()
    # Nothing left replicated: no line.
    assert describe(mlp(), mesh, fsdp("data", min_size=0)).left_replicated == {}
    assert "Left replicated" not in str(describe(mlp(), mesh, fsdp("data", min_size=0)))


def test_fsdp_reasons() -> None:
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    tree = {"scalar": jnp.ones(()), "odd": jnp.ones((3, 5)), "small": jnp.ones((8,))}
    table = describe(tree, mesh, fsdp("data", min_size=100))
    rule = "fsdp(axis='data', min_size=100)"
    assert table.left_replicated == {
        f"{rule}: fewer than `min_size` elements, and no dim divisible by 8": (1, 60),
        f"{rule}: scalars": (1, 4),
        f"{rule}: fewer than `min_size` elements": (1, 32),
    }
    two = make_mesh("auto", shape=(1, 8), names=("data", "model"))
    one_way = describe({"w": jnp.ones((64, 64))}, two, fsdp("data", min_size=0))
    assert one_way.left_replicated == {
        "fsdp(axis='data', min_size=0): mesh axes ('data',) have size 1": (1, 64 * 64 * 4)
    }


def test_describe_of_a_tree_of_rules_asks_the_rule_that_placed_each_leaf() -> None:
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    model = eqxshard.filter_shard(mlp(), mesh, fsdp("data"))
    params = eqx.filter(model, eqx.is_array)
    state = optax.adam(1e-3).init(params)
    spec = (path_rules([(r"layers\.0\.bias", P())]) | fsdp("data"), like(params))
    table = describe((model, state), mesh, spec)
    counts = {reason.split(": ", 1)[1]: n for reason, (n, _) in table.left_replicated.items()}
    # layers.0.bias was asked `P()` by a path rule, which gives no reason: two fsdp biases.
    assert counts == {
        "fewer than `min_size` elements": 2,
        "mirrors a parameter that is replicated": 6,
        "mirrors no parameter, fewer than `min_size` elements": 1,  # adam's count
    }
    # A PartitionSpec, or no spec at all, is not a rule: nothing to summarise.
    assert describe(model, mesh, P()).left_replicated == {}
    assert describe(model).left_replicated == {}
    assert first(fsdp("data")).replicated_because((), jnp.ones(()), mesh) == (
        "fsdp(axis='data', min_size=16384): scalars"
    )


def test_logical_reasons() -> None:
    mesh = make_mesh("auto", shape=(1, 8), names=("data", "model"))
    tree = {"a": jnp.ones((8, 8)), "b": jnp.ones((8, 8)), "c": jnp.ones((8, 8)), "d": jnp.ones(8)}
    rules = path_rules([("a", P("embed", None)), ("b", P("batch")), ("c", P()), ("d", P("mlp"))])
    mapping = {"embed": None, "batch": "data", "mlp": "model"}
    table = describe(tree, mesh, eqxshard.logical(rules, mapping))
    who = f"logical(..., {mapping!r})"
    assert table.left_replicated == {
        f"{who}: logical names ['embed'] map to no mesh axis": (1, 256),
        f"{who}: mesh axes ['data'] have size 1": (1, 256),
        f"{who}: no logical name for any dim": (1, 256),
    }  # "d" is split over "model": no reason
    # A spec with no names from a rule that says why: that rule's reason.
    small = describe({"w": jnp.ones((8, 4))}, mesh, eqxshard.logical(fsdp("model"), {}))
    assert small.left_replicated == {
        "fsdp(axis='model', min_size=16384): fewer than `min_size` elements": (1, 128)
    }
