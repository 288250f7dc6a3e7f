"""Renamed and moved public names keep working, each with one `DeprecationWarning` naming
the new one; the docs use only the new names. Also: the one leaf-path form (a path
printed by an error is a `path_rules` pattern for that leaf), and `clear_caches`."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import make_mesh
from jax.sharding import PartitionSpec as P

import eqxshard
from eqxshard import _caches

ROOT = Path(__file__).parent.parent

# Old top-level name -> where it lives now.
MOVED = {
    "filter_plan": eqxshard.filter_shardings,
    "Candidate": eqxshard.report.Candidate,
    "LeafRow": eqxshard.report.LeafRow,
    "ShardingTable": eqxshard.report.ShardingTable,
    "StageRow": eqxshard.report.StageRow,
    "StepLeaf": eqxshard.report.StepLeaf,
    "StepReport": eqxshard.report.StepReport,
    "SetupReport": eqxshard.report.SetupReport,
    "Link": eqxshard.links.Link,
    "LINKS": eqxshard.links.LINKS,
    "Rule": eqxshard.rules.Rule,
    "NO_MATCH": eqxshard.rules.NO_MATCH,
    "dotted_path": eqxshard.rules.dotted_path,
}
NEW_NAME = {
    "filter_plan": "eqxshard.filter_shardings",
    **{n: f"eqxshard.report.{n}" for n in ("Candidate", "LeafRow", "ShardingTable")},
    **{n: f"eqxshard.report.{n}" for n in ("StageRow", "StepLeaf", "StepReport", "SetupReport")},
    **{n: f"eqxshard.links.{n}" for n in ("Link", "LINKS")},
    **{n: f"eqxshard.rules.{n}" for n in ("Rule", "NO_MATCH", "dotted_path")},
}


@pytest.mark.parametrize("old", list(MOVED))
def test_an_old_name_gives_the_new_object_and_warns_once_naming_it(old: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(eqxshard, old)
    assert value is MOVED[old]
    assert [w.category for w in caught] == [DeprecationWarning]
    message = str(caught[0].message)
    assert f"`eqxshard.{old}` is deprecated: use `{NEW_NAME[old]}`" in message
    assert caught[0].filename == __file__  # the warning points at the caller's line


def test_from_import_of_an_old_name_warns_too() -> None:
    with pytest.warns(DeprecationWarning, match=r"use `eqxshard.report.Candidate`"):
        from eqxshard import Candidate  # noqa: F401


def test_unknown_names_are_still_attribute_errors() -> None:
    with pytest.raises(AttributeError, match=r"module 'eqxshard' has no attribute 'nope'"):
        eqxshard.nope  # pyright: ignore[reportAttributeAccessIssue]  # noqa: B018
    assert not hasattr(eqxshard, "also_not_there")


def test_the_old_names_are_not_listed_and_the_new_modules_are() -> None:
    listed = set(dir(eqxshard))
    assert not listed & set(MOVED)
    assert {"report", "links", "rules", "filter_shardings", "Pipeline", "clear_caches"} <= listed


def test_filter_plan_still_works() -> None:
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    tree = {"w": jnp.ones((8, 2))}
    with pytest.warns(DeprecationWarning, match=r"use `eqxshard.filter_shardings`"):
        old = eqxshard.filter_plan(tree, mesh, P("data"))  # pyright: ignore[reportAttributeAccessIssue]
    assert old == eqxshard.filter_shardings(tree, mesh, P("data"))


# `filter_pipeline`'s schedule keyword.


@pytest.fixture
def stage_mesh() -> Any:
    return make_mesh("auto", shape=(4,), names=("stage",))


def _pipeline(mesh: Any, **kwargs: Any) -> Any:
    blocks = {"w": jnp.stack([jnp.eye(4) * (1 + i / 10) for i in range(8)])}
    layer = lambda block, h: jnp.tanh(h @ block["w"])
    return eqxshard.filter_pipeline(
        layer, blocks, jnp.ones((8, 4)), mesh=mesh, microbatches=4, **kwargs
    )


def test_repeats_without_schedule_still_runs_circular_and_warns(stage_mesh: Any) -> None:
    with pytest.warns(DeprecationWarning, match=r'pass `schedule="circular", repeats=2`'):
        old = _pipeline(stage_mesh, repeats=2)
    new = _pipeline(stage_mesh, schedule="circular", repeats=2)
    assert jnp.allclose(old, new) and jnp.allclose(new, _pipeline(stage_mesh, schedule="gpipe"))
    _pipeline(stage_mesh, repeats=1)  # one chunk per stage, as before: no warning


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"schedule": "gpipe", "repeats": 2}, ValueError, r'`schedule="gpipe"` with `repeats=2`'),
        ({"schedule": "circular"}, ValueError, r'`schedule="circular"` with `repeats=None`'),
        ({"schedule": "circular", "repeats": 1}, ValueError, r"`repeats=1`: the circular"),
        ({"schedule": "1f1b"}, ValueError, r"`schedule='1f1b'`; the schedules are 'gpipe'"),
        ({"schedule": 2}, TypeError, r"takes `schedule` as one of 'gpipe', 'circular'"),
    ],
)
def test_a_schedule_that_contradicts_repeats_is_refused(
    stage_mesh: Any, kwargs: dict, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        _pipeline(stage_mesh, **kwargs)


# `Plan.pipeline`: a `Pipeline`; the dict form still read.


def test_a_plan_pasted_with_a_pipeline_dict_is_read_and_warns() -> None:
    with pytest.warns(DeprecationWarning, match=r"give the pipeline as `Pipeline\(axis=\.\.\."):
        old = eqxshard.Plan(
            {"stage": 2}, P(), P(), pipeline={"axis": "stage", "microbatches": 4, "repeats": 1}
        )
    new = eqxshard.Plan({"stage": 2}, P(), P(), pipeline=eqxshard.Pipeline("stage", 4))
    assert old == new and old.pipeline == eqxshard.Pipeline(axis="stage", microbatches=4)
    assert eval(repr(new), vars(eqxshard) | {"P": P}) == new
    assert "pipeline=Pipeline(axis='stage', microbatches=4, repeats=1, in_step=False)" in repr(new)


def test_indexing_a_plan_pipeline_still_works_and_warns() -> None:
    pipeline = eqxshard.Pipeline(axis="stage", microbatches=4, repeats=2)
    with pytest.warns(DeprecationWarning, match=r"read `plan.pipeline.axis` instead"):
        assert pipeline["axis"] == "stage"
    with pytest.warns(DeprecationWarning, match=r"`plan.pipeline.in_step`"):
        assert pipeline["in_step"] is False
    assert pipeline.schedule == "circular" and eqxshard.Pipeline("s", 4).schedule == "gpipe"


# One leaf-path form.


class _Net(eqx.Module):
    layers: list
    extra: dict


def _net() -> _Net:
    k1, k2 = jax.random.split(jax.random.key(0))
    layers = [eqx.nn.Linear(8, 4, key=k1), eqx.nn.Linear(4, 6, key=k2)]
    return _Net(layers, {"scale": jnp.ones(6)})


def test_a_path_printed_by_an_error_pasted_into_path_rules_matches_that_leaf() -> None:
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    net = _net()
    with pytest.raises(ValueError, match="cannot split these leaves evenly") as info:
        eqxshard.filter_shard(net, mesh, P("data"))
    rows = str(info.value).splitlines()[1:-1]
    printed = [row.split()[0] for row in rows]
    assert printed == [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
        "extra.scale",
    ]
    # Each path, pasted as a pattern, gives exactly that leaf its spec.
    for path in printed:
        rules = eqxshard.path_rules([(path, None), (r".*", P())])
        specs = eqxshard.filter_shardings(net, mesh, rules)
        leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: x is None)[0]
        left_alone = [eqxshard.rules.dotted_path(p) for p, s in leaves if s is None]
        assert left_alone == [path], (path, left_alone)


@pytest.mark.parametrize(
    ("pattern", "path"),
    [
        (".layers[0].weight", "layers.0.weight"),
        (".layers[1].bias", "layers.1.bias"),
        (".extra['scale']", "extra.scale"),
        ('.extra["scale"]', "extra.scale"),
    ],
)
def test_a_keystr_pattern_matches_its_leaf(pattern: str, path: str) -> None:
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    rules = eqxshard.path_rules([(pattern, None), (r".*", P())])
    specs = eqxshard.filter_shardings(_net(), mesh, rules)
    leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: x is None)[0]
    assert [eqxshard.rules.dotted_path(p) for p, s in leaves if s is None] == [path]
    assert repr(re.escape(path)) in repr(rules)  # read as that one path, written dotted


def test_a_regular_expression_is_not_read_as_a_keystr_path() -> None:
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    rules = eqxshard.path_rules([(r"layers\.[0-9]\.weight", None), (r".*", P())])
    specs = eqxshard.filter_shardings(_net(), mesh, rules)
    assert specs.layers[0].weight is None and specs.layers[1].weight is None
    assert specs.layers[0].bias is not None


# `clear_caches`.


def test_clear_caches_empties_every_registered_cache() -> None:
    cache = {"compiled": object()}
    clear = _caches.register(cache.clear)
    try:
        eqxshard.clear_caches()
        assert cache == {}
    finally:
        _caches._CLEARS.remove(clear)
    cache["compiled"] = object()
    eqxshard.clear_caches()  # no longer registered
    assert "compiled" in cache


# The docs use the new names.

OLD_IN_CODE = re.compile(
    r"eqxshard\.(filter_plan|Candidate|LeafRow|ShardingTable|StageRow|StepLeaf|StepReport|"
    r"SetupReport|Link|LINKS|Rule|NO_MATCH|dotted_path)\b|\bfilter_plan\("
)


def test_the_docs_and_examples_use_the_new_names() -> None:
    pages = [*(ROOT / "docs").glob("**/*.md"), ROOT / "README.md"]
    pages += [*(ROOT / "docs").glob("**/*.ipynb"), *(ROOT / "examples").glob("*")]
    found = []
    for page in pages:
        if page.name == "api.md" or not page.is_file():
            continue  # api.md lists the old names, as old names
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if OLD_IN_CODE.search(line):
                found.append(f"{page.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
