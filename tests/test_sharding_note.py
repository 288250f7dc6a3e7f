"""The note `filter_jit` adds to JAX's `ShardingTypeError` on Explicit mesh axes
(eqxshard/_step/jit.py, `explained`)."""

from __future__ import annotations

import traceback
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqxshard
from eqxshard import _compat


def embedding_and_tokens(kind: AxisType):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    emb = jax.device_put(eqx.nn.Embedding(100, 16, key=jax.random.key(0)), NamedSharding(mesh, P()))
    tok = jax.device_put(jnp.arange(16), NamedSharding(mesh, P("data")))
    return emb, tok


def lookup(emb, tok):
    return jax.vmap(emb)(tok)


def contract(x):
    return x.T @ x  # the contracting dim is split: JAX asks for `out_sharding=` on every version


def test_a_split_contraction_on_explicit_axes_gets_a_note() -> None:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data")))
    with pytest.raises(Exception, match=r"out_sharding") as info:
        eqxshard.filter_jit(contract)(x)
    assert _compat.is_sharding_type_error(info.value)  # JAX's own error, kept
    notes = [n for n in getattr(info.value, "__notes__", []) if n.startswith("eqxshard")]
    assert len(notes) == 1
    assert "Explicit axes ('data')" in notes[0]
    assert "axis_types=(jax.sharding.AxisType.Auto,) * len(shape)" in notes[0]
    assert "`out_sharding=`" in notes[0]
    # The traceback still reaches the user's function.
    frames = traceback.extract_tb(info.value.__traceback__)
    assert any(f.name == "contract" for f in frames)
    # `lower` says the same.
    with pytest.raises(Exception, match=r"out_sharding") as info:
        cast(Any, eqxshard.filter_jit(contract)).lower(x)
    assert any("Explicit axes ('data')" in n for n in info.value.__notes__)


def test_an_embedding_lookup_on_explicit_axes_gets_a_note() -> None:
    emb, tok = embedding_and_tokens(AxisType.Explicit)
    try:
        expected = jax.jit(lookup)(emb, tok)
    except Exception as error:  # jax >= 0.8 refuses the gather; 0.7 ran it
        assert _compat.is_sharding_type_error(error)
    else:
        assert jnp.array_equal(eqxshard.filter_jit(lookup)(emb, tok), expected)
        return
    with pytest.raises(Exception, match=r"out_sharding") as info:
        eqxshard.filter_jit(lookup)(emb, tok)
    assert _compat.is_sharding_type_error(info.value)
    notes = [n for n in getattr(info.value, "__notes__", []) if n.startswith("eqxshard")]
    assert len(notes) == 1 and "Explicit axes ('data')" in notes[0]
    frames = traceback.extract_tb(info.value.__traceback__)
    assert any(f.name == "lookup" for f in frames)


def test_the_same_step_on_auto_axes_runs() -> None:
    emb, tok = embedding_and_tokens(AxisType.Auto)
    out = eqxshard.filter_jit(lookup)(emb, tok)
    assert jnp.array_equal(out, emb.weight[jnp.arange(16)])


def test_other_errors_get_no_note() -> None:
    emb, tok = embedding_and_tokens(AxisType.Explicit)

    def fails(emb, tok):
        raise ValueError("mine")

    with pytest.raises(ValueError, match="mine") as info:
        eqxshard.filter_jit(fails)(emb, tok)
    assert not any("eqxshard" in n for n in getattr(info.value, "__notes__", []))


def test_is_sharding_type_error_matches_by_name() -> None:
    class ShardingTypeError(Exception):
        pass

    class Other(ShardingTypeError):
        pass

    assert _compat.is_sharding_type_error(Other())
    assert not _compat.is_sharding_type_error(TypeError())
