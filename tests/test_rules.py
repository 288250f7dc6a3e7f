"""Sharding rules: path rules, FSDP, logical axis names, composition (eqxshard/_plans/rules.py)."""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import MESH_KINDS, assert_placed, assert_sharding, make_mesh, named
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

import eqxshard
from eqxshard import filter_shardings, first, fsdp, logical, path_rules
from eqxshard.rules import NO_MATCH, Rule, dotted_path


def mlp(key: int = 0) -> eqx.nn.MLP:
    # weights (16, 8), (16, 16), (4, 16); biases (16,), (16,), (4,)
    return eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(key))


def abstract_mlp() -> eqx.nn.MLP:
    return eqx.filter_eval_shape(mlp)


def specs(plan: eqx.nn.MLP) -> dict[str, P]:
    """The spec of each leaf of a plan, by dotted path."""
    leaves = jax.tree_util.tree_flatten_with_path(plan)[0]
    return {dotted_path(p): s.spec for p, s in leaves if s is not None}


# ----------------------------------------------------------------------------- paths


def test_dotted_path_joins_attributes_indices_and_keys() -> None:
    assert dotted_path((GetAttrKey("layers"), SequenceKey(0), GetAttrKey("weight"))) == (
        "layers.0.weight"
    )
    assert dotted_path((DictKey("enc"), DictKey(3), SequenceKey(1))) == "enc.3.1"
    assert dotted_path(()) == ""
    tree = {"a": [jnp.ones(2), (jnp.ones(2),)], "b": mlp()}
    paths = [dotted_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert paths[:2] == ["a.0", "a.1.0"]
    assert "b.layers.2.bias" in paths


# ----------------------------------------------------------------------------- path rules


@pytest.mark.parametrize("kind", MESH_KINDS)
@pytest.mark.parametrize("abstract", [False, True])
def test_path_rules_first_match_wins(kind: str, abstract: bool) -> None:
    mesh = make_mesh(kind)
    rules = path_rules(
        [
            (r"layers\.0\.weight", P("data", "model")),
            (r"layers\.\d\.weight", P(None, "model")),
            (r".*", P()),
        ]
    )
    tree = abstract_mlp() if abstract else mlp()
    got = specs(filter_shardings(tree, mesh, rules))
    assert got["layers.0.weight"] == P("data", "model")
    assert got["layers.1.weight"] == P(None, "model")
    assert got["layers.2.weight"] == P(None, "model")
    assert got["layers.0.bias"] == P()


def test_path_rules_match_the_whole_path() -> None:
    mesh = make_mesh("explicit")
    # "weight" alone matches no whole path; ".*weight" does.
    rules = path_rules([(r"weight", P("data")), (r".*weight", P(None, "model")), (r".*", P())])
    with pytest.warns(UserWarning, match=r"gave no leaf its spec: path_rules pattern 'weight'\."):
        got = specs(filter_shardings(mlp(), mesh, rules))
    assert got["layers.0.weight"] == P(None, "model")


def test_path_rules_take_a_dict_compiled_patterns_and_none() -> None:
    mesh = make_mesh("auto")
    rules = path_rules({re.compile(r".*bias"): None, r".*": P("data")})
    model = mlp()
    plan = filter_shardings(model, mesh, rules)
    assert plan.layers[0].bias is None  # left alone
    assert plan.layers[0].weight.spec == P("data")
    placed = eqxshard.filter_shard(model, mesh, rules)
    assert_placed(placed.layers[0].weight, named(mesh, "data"), model.layers[0].weight)
    assert placed.layers[0].bias is model.layers[0].bias


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_rules_inside_jit(kind: str) -> None:
    mesh = make_mesh(kind)
    rules = path_rules([(r".*weight", P("data")), (r".*", P())])

    @eqx.filter_jit
    def f(model):
        return eqxshard.filter_shard(model, mesh, rules)

    out = f(mlp())
    assert_sharding(out.layers[1].weight.sharding, named(mesh, "data"), 2)
    assert_sharding(out.layers[1].bias.sharding, named(mesh), 1)


def test_path_rules_unmatched_leaves_are_one_error() -> None:
    mesh = make_mesh("auto")
    rules = path_rules([(r"layers\.0\..*", P())])
    with pytest.raises(ValueError, match="has no rule that matches") as info:
        eqxshard.filter_shard(mlp(), mesh, rules)
    message = str(info.value)
    for path in ("layers.1.weight", "layers.1.bias", "layers.2.weight", "layers.2.bias"):
        assert f"\n  {path} " in message
    assert "\n  layers.0" not in message
    assert r"'layers\\.0\\..*'" in message and "catch-all" in message
    with pytest.raises(ValueError, match="`filter_shardings` has no rule"):
        filter_shardings(abstract_mlp(), mesh, rules)


@pytest.mark.parametrize(
    ("rules", "match"),
    [
        ([("a", P(), "extra")], "is not a \\(pattern, spec\\) pair"),
        ([("(", P())], "is not a regular expression"),
        ([(3, P())], "is not a regular expression"),
        ([(".*", "data")], "is not a PartitionSpec or None"),
    ],
)
def test_path_rules_bad_items(rules, match) -> None:
    with pytest.raises(TypeError, match=match):
        path_rules(rules)


def test_path_rules_not_a_list() -> None:
    with pytest.raises(TypeError, match="takes a list of \\(pattern, spec\\) pairs, but got str"):
        path_rules(".*")  # type: ignore[arg-type]


def test_path_rules_checked_like_any_spec() -> None:
    mesh = make_mesh("auto")  # data: 4, model: 2
    rules = path_rules([(r".*", P("model", "data"))])
    with pytest.raises(ValueError, match="more entries than their leaves have dims"):
        eqxshard.filter_shard(mlp(), mesh, rules)
    with pytest.raises(ValueError, match="naming axes its mesh does not have"):
        filter_shardings(mlp(), mesh, path_rules([(r".*", P("nope"))]))


# ----------------------------------------------------------------------------- fsdp


def test_fsdp_largest_divisible_dim_ties_go_first() -> None:
    mesh = make_mesh("explicit", shape=(8,), names=("data",))
    tree = {
        "tall": jax.ShapeDtypeStruct((64, 8), jnp.float32),
        "wide": jax.ShapeDtypeStruct((8, 64), jnp.float32),
        "tie": jax.ShapeDtypeStruct((16, 16), jnp.float32),
        "skip": jax.ShapeDtypeStruct((12, 24, 16), jnp.float32),  # 24 % 8 == 0, 12 % 8 != 0
        "small": jax.ShapeDtypeStruct((8, 8), jnp.float32),
        "scalar": jax.ShapeDtypeStruct((), jnp.float32),
    }
    got = specs(filter_shardings(tree, mesh, fsdp("data", min_size=64)))
    assert got == {
        "tall": P("data"),
        "wide": P(None, "data"),
        "tie": P("data"),
        "skip": P(None, "data"),
        "small": P("data"),  # 64 elements: not below min_size
        "scalar": P(),
    }
    got = specs(filter_shardings(tree, mesh, fsdp("data", min_size=65)))
    assert got["small"] == P() and got["tall"] == P("data")


def test_fsdp_default_threshold() -> None:
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    tree = {
        "big": jax.ShapeDtypeStruct((128, 128), jnp.float32),  # 2**14 elements
        "under": jax.ShapeDtypeStruct((127, 128), jnp.float32),
    }
    got = specs(filter_shardings(tree, mesh, fsdp()))
    assert got == {"big": P("data"), "under": P()}


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_fsdp_over_two_axes_places_concrete_leaves(kind: str) -> None:
    mesh = make_mesh(kind)  # data: 4, model: 2 -> 8 parts
    model = mlp()
    placed = eqxshard.filter_shard(model, mesh, fsdp(("data", "model"), min_size=16))
    assert_placed(placed.layers[1].weight, named(mesh, ("data", "model")), model.layers[1].weight)
    assert_placed(placed.layers[2].bias, named(mesh), model.layers[2].bias)  # 4 elements


def test_fsdp_axis_of_size_one_replicates() -> None:
    mesh = make_mesh("auto", shape=(8, 1), names=("data", "model"))
    got = specs(filter_shardings(abstract_mlp(), mesh, fsdp("model", min_size=0)))
    assert set(got.values()) == {P()}


def test_fsdp_no_divisible_dim_lists_every_leaf() -> None:
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    tree = {
        "a": jax.ShapeDtypeStruct((6, 10), jnp.float32),
        "b": jax.ShapeDtypeStruct((3,), jnp.float32),
        "c": jax.ShapeDtypeStruct((16, 3), jnp.float32),
    }
    with pytest.raises(ValueError, match="no dim is divisible by 8") as info:
        filter_shardings(tree, mesh, fsdp("data", min_size=0))
    assert "\n  a  " in str(info.value) and "\n  b  " in str(info.value)
    assert "\n  c  " not in str(info.value) and "raise `min_size`" in str(info.value)
    # Raising min_size above their sizes replicates them instead.
    assert specs(filter_shardings(tree, mesh, fsdp("data", min_size=61)))["a"] == P()


def test_fsdp_axis_the_mesh_lacks() -> None:
    mesh = make_mesh("auto")
    with pytest.raises(ValueError, match=r"`fsdp` over mesh axes \['fsdp'\] that the mesh lacks"):
        filter_shardings(mlp(), mesh, fsdp("fsdp"))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"axis": 3}, TypeError, "takes `axis` as a mesh axis name"),
        ({"axis": ()}, TypeError, "takes `axis` as a mesh axis name"),
        ({"min_size": 1.5}, TypeError, "takes `min_size` as an int"),
        ({"min_size": True}, TypeError, "takes `min_size` as an int"),
        ({"min_size": -1}, ValueError, "takes `min_size` >= 0"),
    ],
)
def test_fsdp_bad_arguments(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        fsdp(**kwargs)


# ----------------------------------------------------------------------------- logical


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_logical_maps_names_to_mesh_axes(kind: str) -> None:
    mesh = make_mesh(kind)
    rules = path_rules(
        [
            (r"layers\.[01]\.weight", P("mlp", "embed")),
            (r"layers\.2\.weight", P("embed", "mlp")),
            (r"layers\.[01]\.bias", P(("batch", "mlp"))),
            (r".*", P("embed")),
        ]
    )
    mapping = {"embed": None, "mlp": "model", "batch": "data"}
    got = specs(filter_shardings(abstract_mlp(), mesh, logical(rules, mapping)))
    assert got["layers.0.weight"] == P("model", None)
    assert got["layers.2.weight"] == P(None, "model")
    assert got["layers.0.bias"] == P(("data", "model"))
    placed = eqxshard.filter_shard(mlp(), mesh, logical(rules, mapping))
    assert_placed(placed.layers[1].weight, named(mesh, "model", None), mlp().layers[1].weight)


def test_logical_takes_a_spec_tree_and_tuples() -> None:
    mesh = make_mesh("explicit")
    spec_tree = jax.tree.map(lambda _: P(), mlp())
    spec_tree = eqx.tree_at(lambda m: m.layers[1].weight, spec_tree, P("rows", None))
    rule = logical(spec_tree, {"rows": ("data", "model")})
    got = specs(filter_shardings(mlp(), mesh, rule))
    assert got["layers.1.weight"] == P(("data", "model"), None)
    assert got["layers.0.weight"] == P()


def test_logical_unmapped_names_are_one_error() -> None:
    mesh = make_mesh("auto")
    rules = path_rules([(r".*weight", P("mlp", "embed")), (r".*", P("vocab"))])
    with pytest.raises(ValueError, match="logical axis names that the `logical` mapping") as info:
        filter_shardings(mlp(), mesh, logical(rules, {"mlp": "model"}))
    message = str(info.value)
    assert "['embed']" in message and "['vocab']" in message
    assert "\n  layers.2.bias" in message and "Mapped names: ['mlp']" in message


def test_logical_mapping_to_an_axis_the_mesh_lacks() -> None:
    mesh = make_mesh("auto")
    with pytest.raises(ValueError, match="naming axes its mesh does not have"):
        filter_shardings(mlp(), mesh, logical(P("embed"), {"embed": "tensor"}))


@pytest.mark.parametrize(
    ("mapping", "match"),
    [
        ([("embed", None)], "takes `mapping` as a dict"),
        ({"embed": 3}, "'embed': 3"),
        ({"embed": ("data", 1)}, "'embed'"),
        ({1: "data"}, "1: 'data'"),
    ],
)
def test_logical_bad_mapping(mapping, match) -> None:
    with pytest.raises(TypeError, match=match):
        logical(P("embed"), mapping)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- composition


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_path_rules_then_fsdp(kind: str) -> None:
    mesh = make_mesh(kind)
    rules = path_rules([(r"layers\.2\..*", P())]) | fsdp("data", min_size=0)
    got = specs(filter_shardings(abstract_mlp(), mesh, rules))
    assert got["layers.2.weight"] == P() and got["layers.2.bias"] == P()
    assert got["layers.0.weight"] == P("data") and got["layers.1.bias"] == P("data")
    assert specs(filter_shardings(abstract_mlp(), mesh, first(path_rules([]), P("data")))) == {
        k: P("data") for k in got
    }


def test_composition_with_plain_specs_on_either_side() -> None:
    mesh = make_mesh("auto")
    spec_tree = {"a": P("data"), "b": None}
    tree = {"a": jnp.ones((8, 2)), "b": jnp.ones(4), "c": jnp.ones(4)}
    rule = spec_tree | path_rules([(r"c", P("model"))])
    plan = filter_shardings(tree, mesh, rule)
    assert plan["a"].spec == P("data") and plan["b"] is None and plan["c"].spec == P("model")
    rule = path_rules([(r"a", P("data"))]) | P()
    assert filter_shardings(tree, mesh, rule)["b"].spec == P()
    assert isinstance(None | path_rules([]), Rule)


def test_composition_flattens_and_calls_callables() -> None:
    mesh = make_mesh("auto")
    a, b = path_rules([(r"x", P("data"))]), path_rules([(r"y", P("model"))])
    rule = first(a | b, lambda path, leaf: P() if leaf.ndim == 1 else None)
    assert len(rule.rules) == 3
    tree = {"x": jnp.ones(8), "y": jnp.ones(8), "z": jnp.ones(8), "w": jnp.ones((2, 2))}
    plan = filter_shardings(tree, mesh, rule)
    assert [plan[k] and plan[k].spec for k in "xyzw"] == [P("data"), P("model"), P(), None]


def test_first_no_rule_matches_and_empty() -> None:
    mesh = make_mesh("auto")
    rule = first({"a": P()}, path_rules([(r"b", P())]))
    tree = {"a": jnp.ones(4), "b": jnp.ones(4), "c": jnp.ones(4), "d": jnp.ones(4)}
    with pytest.raises(ValueError, match="no rule that matches") as info:
        filter_shardings(tree, mesh, rule)
    assert "\n  c  " in str(info.value) and "\n  d  " in str(info.value)
    assert "first(..., P())" in str(info.value)
    with pytest.raises(TypeError, match="at least one rule"):
        first()


def test_spec_tree_with_a_non_spec_leaf() -> None:
    words = r"must have one of these at every leaf.*\n  b: str\nPut a PartitionSpec, a rule"
    with pytest.raises(TypeError, match=words):
        first({"a": P(), "b": "data"})


def test_spec_tree_leaves_outside_it_are_an_error() -> None:
    mesh = make_mesh("auto")
    with pytest.raises(ValueError, match="Give the spec tree the structure of the model"):
        filter_shardings({"a": jnp.ones(4), "b": jnp.ones(4)}, mesh, logical({"a": P()}, {}))


def test_custom_rule() -> None:
    class ByRank(Rule):
        def match(self, path, leaf, mesh):
            return P("data") if leaf.ndim == 2 else NO_MATCH

    mesh = make_mesh("auto")
    got = specs(filter_shardings(abstract_mlp(), mesh, ByRank() | P()))
    assert got["layers.0.weight"] == P("data") and got["layers.0.bias"] == P()
    with pytest.raises(ValueError, match="has no rule that matches"):
        filter_shardings(abstract_mlp(), mesh, ByRank())


def test_rule_with_a_sharding_target_is_a_type_error() -> None:
    mesh = make_mesh("auto")
    with pytest.raises(TypeError, match="a rule `spec` was given with target NamedSharding"):
        eqxshard.filter_shard(mlp(), named(mesh), fsdp())


def test_reprs_read_like_the_calls() -> None:
    rule = path_rules([(r"a", P())]) | fsdp("data", min_size=0)
    assert "path_rules(" in repr(rule) and "fsdp(axis='data', min_size=0)" in repr(rule)
    assert "logical(" in repr(logical(P("x"), {"x": None}))


def test_a_pattern_that_gives_no_leaf_its_spec_is_a_warning_alone_and_inside_first() -> None:
    import warnings

    mesh = make_mesh("auto")
    model = mlp()
    typo = r"layers\.\d+\.wieght"
    alone = path_rules([(typo, P("data")), (r".*", P())])
    shadowed = path_rules([(r".*", P()), (r".*weight", P("data"))])  # `.*` took every leaf
    wanted = {
        "alone": (alone, [typo]),
        "first": (path_rules([(typo, P("data"))]) | fsdp("data"), [typo]),
        "after a rule that took every leaf": (
            fsdp("data") | path_rules([(".*bias", P())]),
            [".*bias"],
        ),
        "shadowed": (shadowed, [".*weight"]),
        "logical": (logical(path_rules([(typo, P("x"))]), {"x": "data"}) | P(), [typo]),
        "a tree inside first": (first({"layers": path_rules([(typo, P())])}, P()), [typo]),
        "a spec tree": ((path_rules([(typo, P())]) | P(), None), [typo]),
    }
    for name, (spec, patterns) in wanted.items():
        tree = (model, model) if isinstance(spec, tuple) else model
        with pytest.warns(UserWarning) as caught:
            filter_shardings(tree, mesh, spec)
        message = str(caught[0].message)
        assert len(caught) == 1
        assert "`filter_shardings`: these parts of the `spec` rules gave no" in message
        for pattern in patterns:
            assert f"path_rules pattern {pattern!r}" in message, name
    # Every pattern used (an unused catch-all is a safeguard, not a typo): no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        filter_shardings(model, mesh, path_rules([(r".*", P())]) | fsdp("data"))
        filter_shardings(
            model, mesh, path_rules([(r".*weight", P()), (r".*bias", P()), (".*", P())])
        )
        eqxshard.filter_shard(model, mesh, path_rules([(r".*weight", P())]) | P())
        # `describe` is asked about parts of a model with the whole's rule: no warning,
        # the pattern is listed below the table.
        part = eqxshard.describe(
            model.layers[0], mesh, path_rules([(r"layers\.0\.w.*", P())]) | P()
        )
        assert part.unmatched == [r"path_rules pattern 'layers\\.0\\.w.*'"]
    with pytest.warns(UserWarning, match=r"`filter_shard`: (.|\n)*'nothing'"):
        eqxshard.filter_shard(model, mesh, path_rules([("nothing", P())]) | P())


@pytest.mark.parametrize(
    ("rule", "names", "lead"),
    [
        (lambda: fsdp("dta"), ("data", "fsdp"), r"`fsdp` over mesh axes \['dta'\] that the mesh "),
        (
            lambda: eqxshard.stages("stgae"),
            ("stage", "data"),
            r"`stages` over the mesh axis 'stgae'",
        ),
    ],
)
def test_a_misspelt_axis_leads_with_the_fix_then_a_capped_leaf_list(rule, names, lead) -> None:
    mesh = make_mesh("auto", shape=(4, 2), names=names)
    deep = eqx.nn.MLP(8, 8, 8, depth=30, key=jax.random.key(0))  # 62 leaves
    with pytest.raises(ValueError) as info:
        filter_shardings(deep, mesh, rule())
    lines = str(info.value).splitlines()
    axes = re.escape(repr(names))
    assert re.match(
        rf"`filter_shardings` was given {lead}.*has axes {axes}\. Did you mean ", lines[0]
    )
    assert "Did you mean 'data'?" in lines[0] or "Did you mean 'stage'?" in lines[0]
    assert lines[1:3] == ["  layers.0.weight", "  layers.0.bias"]
    assert lines[11] == "  ... and 52 more"
    assert len(lines) == 13


def test_a_pattern_that_matches_nothing_names_its_near_misses() -> None:
    mesh = make_mesh("auto")
    rules = path_rules([(r"layers\.\d+\.wieght", P("data")), (r".*", P())])
    near = r"'layers\\\\\.\\\\d\+\\\\\.wieght' \(near misses: 'layers\.0\.weight', "
    with pytest.warns(UserWarning, match=near):
        filter_shardings(mlp(), mesh, rules)
    # `describe` lists it below its table, with the same near misses.
    table = eqxshard.describe(abstract_mlp(), mesh, rules)
    assert len(table.unmatched) == 1 and re.search(near, table.unmatched[0])
    assert re.search(r"Rules that gave no leaf its spec: path_rules pattern " + near, str(table))
    # A rule that matches a leaf, as asked, is listed in neither.
    matched = path_rules([(r".*weight", P("data")), (r".*", P())])
    assert eqxshard.describe(abstract_mlp(), mesh, matched).unmatched == []
    assert "gave no leaf" not in str(eqxshard.describe(abstract_mlp(), mesh, matched))
