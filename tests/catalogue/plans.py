"""Bad inputs to the plan verbs and sharding rules: `path_rules`, `fsdp`, `logical`, `like`,
`first`, `filter_shardings`, `describe`, `filter_init`."""

# Every case passes a bad argument on purpose, to check the error it raises: what a type
# checker says about those arguments is the point of this file, not a mistake in it.
# pyright: reportArgumentType=false, reportCallIssue=false

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqxshard

from . import Case

_mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
_abstract = {
    "w": jax.ShapeDtypeStruct((8, 4), jnp.float32),
    "b": jax.ShapeDtypeStruct((4,), jnp.float32),
}


def _params() -> dict[str, Any]:
    return {"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}


def _make() -> dict[str, Any]:
    return {"w": jnp.ones((6, 4))}


def _plan(spec: Any, target: Any = _mesh) -> Any:
    return lambda: eqxshard.filter_shardings(_abstract, target, spec)


CASES: list[Case] = [
    # ---- path_rules
    Case("path_rules/str", lambda: eqxshard.path_rules("w"), TypeError, r"`path_rules`"),
    Case("path_rules/int", lambda: eqxshard.path_rules(3), TypeError, r"`path_rules`"),  # type: ignore[arg-type]
    Case(
        "path_rules/not-a-pair",
        lambda: eqxshard.path_rules([("w",)]),  # type: ignore[list-item]
        TypeError,
        r"`path_rules`.*\n  rule 0: \('w',\) is not a \(pattern, spec\) pair",
    ),
    Case(
        "path_rules/list-not-tuple",
        lambda: eqxshard.path_rules([["w", P()]]),  # type: ignore[list-item]
        TypeError,
        r"`path_rules`.*\n  rule 0:",
    ),
    Case(
        "path_rules/pattern-int",
        lambda: eqxshard.path_rules([(3, P())]),  # type: ignore[list-item]
        TypeError,
        r"`path_rules`.*\n  rule 0: pattern 3",
    ),
    Case(
        "path_rules/bad-regex",
        lambda: eqxshard.path_rules([("w", P()), ("(", P())]),
        TypeError,
        r"`path_rules`.*\n  rule 1: pattern '\('",
    ),
    Case(
        "path_rules/spec-str",
        lambda: eqxshard.path_rules([("w", "data")]),  # type: ignore[list-item]
        TypeError,
        r"`path_rules`.*\n  rule 0: spec 'data'",
    ),
    Case(
        "path_rules/no-match",
        _plan(eqxshard.path_rules([("w", P())])),
        ValueError,
        r"`filter_shardings` has no rule that matches these leaves:\n  b  shape \(4,\)",
    ),
    Case(
        "path_rules/indivisible",
        _plan(eqxshard.path_rules([(".*", P(("data", "model")))])),
        ValueError,
        r"\n  b  shape \(4,\)  dim 0 = 4 is not divisible by 8",
    ),
    Case(
        "path_rules/unknown-axis",
        _plan(eqxshard.path_rules([("w", P("batch")), (".*", P())])),
        ValueError,
        r"\n  w  spec P\('batch',\)",
    ),
    # ---- fsdp
    Case("fsdp/axis-int", lambda: eqxshard.fsdp(3), TypeError, r"`fsdp` takes `axis`"),  # type: ignore[arg-type]
    Case("fsdp/axis-empty-tuple", lambda: eqxshard.fsdp(()), TypeError, r"`fsdp` takes `axis`"),
    Case("fsdp/axis-list", lambda: eqxshard.fsdp(["data"]), TypeError, r"`fsdp` takes `axis`"),  # type: ignore[arg-type]
    Case("fsdp/min-size-str", lambda: eqxshard.fsdp(min_size="1"), TypeError, r"`min_size`"),  # type: ignore[arg-type]
    Case("fsdp/min-size-bool", lambda: eqxshard.fsdp(min_size=True), TypeError, r"`min_size`"),
    Case("fsdp/min-size-float", lambda: eqxshard.fsdp(min_size=1.0), TypeError, r"`min_size`"),  # type: ignore[arg-type]
    Case("fsdp/min-size-negative", lambda: eqxshard.fsdp(min_size=-1), ValueError, r"`min_size`"),
    Case(
        "fsdp/axis-not-in-mesh",
        _plan(eqxshard.fsdp("nope", min_size=0)),
        ValueError,
        r"`fsdp` over mesh axes \['nope'\].*\n  b",
    ),
    Case(
        "fsdp/no-divisible-dim",
        lambda: eqxshard.filter_shardings(
            {"odd": jax.ShapeDtypeStruct((3, 5), jnp.float32)},
            _mesh,
            eqxshard.fsdp("model", min_size=0),
        ),
        ValueError,
        r"with `fsdp`.*\n  odd  shape \(3, 5\)",
    ),
    Case(
        "fsdp/sharding-target",
        _plan(eqxshard.fsdp("data"), NamedSharding(_mesh, P())),
        TypeError,
        r"\n  w  a rule `spec` was given",
    ),
    # ---- logical
    Case(
        "logical/mapping-list",
        lambda: eqxshard.logical(P("embed"), ["embed"]),
        TypeError,
        r"`logical` takes `mapping`",
    ),  # type: ignore[arg-type]
    Case(
        "logical/mapping-value-int",
        lambda: eqxshard.logical(P("embed"), {"embed": 3}),
        TypeError,
        r"`mapping`.*'embed': 3",
    ),  # type: ignore[dict-item]
    Case(
        "logical/mapping-key-int",
        lambda: eqxshard.logical(P("embed"), {1: "data"}),
        TypeError,
        r"`mapping`.*1: 'data'",
    ),  # type: ignore[dict-item]
    Case(
        "logical/mapping-tuple-of-int",
        lambda: eqxshard.logical(P("embed"), {"embed": (1,)}),
        TypeError,
        r"`mapping`",
    ),  # type: ignore[dict-item]
    Case(
        "logical/spec-tree-leaf-int",
        lambda: eqxshard.logical({"w": 3}, {"embed": "data"}),
        TypeError,
        r"`logical` takes rules.*\n  w: int",
    ),
    Case(
        "logical/unmapped-name",
        _plan(eqxshard.logical(P("embed"), {"mlp": "model"})),
        ValueError,
        r"`logical` mapping does not map:\n  b  spec P\('embed',\)  unmapped \['embed'\]",
    ),
    Case(
        "logical/maps-to-unknown-axis",
        _plan(eqxshard.logical(P("embed"), {"embed": "batch"})),
        ValueError,
        r"\n  w  spec P\('batch',\)",
    ),
    Case(
        "logical/maps-to-indivisible",
        _plan(eqxshard.logical(P("mlp"), {"mlp": ("data", "model")})),
        ValueError,
        r"\n  b  shape \(4,\)",
    ),
    # ---- like
    Case(
        "like/unplaced-params",
        lambda: eqxshard.like({"w": np.ones(8)}),
        ValueError,
        r"`like` cannot read the layout of these parameters:\n  w",
    ),
    Case(
        "like/abstract-params",
        lambda: eqxshard.like(_abstract),
        ValueError,
        r"`like`.*\n  b  is abstract",
    ),
    Case(
        "like/plan-missing-a-leaf",
        lambda: eqxshard.like(_params(), plan={"w": P(), "b": None}),
        ValueError,
        r"`like`.*\n  b  has no Sharding in `plan`",
    ),
    # ---- first and |
    Case("first/no-rules", lambda: eqxshard.first(), TypeError, r"`first` takes at least one rule"),
    Case("first/int-rule", lambda: eqxshard.first(P(), 3), TypeError, r"`first` takes rules"),
    Case("first/or-str", lambda: eqxshard.fsdp("data") | "x", TypeError, r"`first` takes rules"),
    Case(
        "first/no-match",
        _plan(eqxshard.first(eqxshard.path_rules([("w", P())]), {"w": P()})),
        ValueError,
        r"`filter_shardings` has no rule that matches these leaves:\n  b",
    ),
    # ---- filter_shardings
    Case("filter_shardings/spec-int", _plan(3), TypeError, r"`target`/`spec`.*\n  b  spec 3"),
    Case("filter_shardings/target-str", _plan(None, "cpu"), TypeError, r"\n  b  target 'cpu'"),
    Case(
        "filter_shardings/indivisible",
        _plan(P(None, "data"), _mesh),
        ValueError,
        r"\n  b  shape \(4,\)",
    ),
    Case("filter_shardings/no-mesh", _plan(P("data"), None), ValueError, r"no mesh is set.*\n  b"),
    Case(
        "filter_shardings/no-target-no-mesh",
        _plan(None, None),
        ValueError,
        r"no `target` and no mesh is set",
    ),
    Case(
        "filter_shardings/target-tree-not-prefix",
        _plan(None, {"w": _mesh}),
        ValueError,
        r"`target` whose structure is not a prefix of `tree`",
    ),
    Case(
        "filter_shardings/str-array",
        lambda: eqxshard.filter_shardings({"bad": np.array(["x"])}, _mesh),
        TypeError,
        r"dtype JAX has no arrays of:\n  bad",
    ),
    # ---- describe
    Case(
        "describe/unknown-axis",
        lambda: eqxshard.describe(_abstract, _mesh, P("nope")),
        ValueError,
        r"`describe`.*\n  b  spec P\('nope',\)",
    ),
    Case(
        "describe/spec-no-mesh",
        lambda: eqxshard.describe(_abstract, spec=P("data")),
        ValueError,
        r"`describe`.*no mesh is set.*\n  b",
    ),
    Case(
        "describe/target-int",
        lambda: eqxshard.describe(_abstract, 7),
        TypeError,
        r"`describe`.*\n  b  target 7",
    ),
    # ---- filter_init
    Case(
        "filter_init/fn-not-callable",
        lambda: eqxshard.filter_init(3),
        TypeError,
        r"`filter_init` takes a callable `fn`",
    ),  # type: ignore[arg-type]
    Case(
        "filter_init/indivisible",
        lambda: eqxshard.filter_init(_make, _mesh, P("model"))(),
        ValueError,
        r"`filter_init`.*\n  w  shape \(6, 4\)",
    ),
    Case(
        "filter_init/no-mesh",
        lambda: eqxshard.filter_init(_make, spec=P("data"))(),
        ValueError,
        r"`filter_init`.*no mesh is set.*\n  w",
    ),
    Case(
        "filter_init/fsdp-unknown-axis",
        lambda: eqxshard.filter_init(_make, _mesh, eqxshard.fsdp("x", min_size=0))(),
        ValueError,
        r"`fsdp` over mesh axes \['x'\].*\n  w",
    ),
    Case(
        "filter_init/abstract-mesh",
        lambda: eqxshard.filter_init(
            lambda: {"w": jnp.ones(8)}, jax.sharding.AbstractMesh((8,), ("data",)), P("data")
        )(),
        ValueError,
        r"`filter_init` cannot create these leaves on an AbstractMesh.*\n  w",
    ),
]
