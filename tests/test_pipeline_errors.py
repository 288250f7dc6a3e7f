"""`filter_pipeline`'s bad inputs: each a clear error, naming the argument or leaf path and
the fix, raised before anything runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import make_mesh
from jax.sharding import PartitionSpec as P

import eqxshard
from eqxshard import _compat
from eqxshard._pipeline import remat


def _layer(block, h):
    return jnp.tanh(h @ block["w"] + block["b"])


def _blocks(n=8):
    return {"w": jnp.ones((n, 4, 4)), "b": jnp.ones((n, 4))}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("explicit", shape=(4,), names=("stage",))


def _run(mesh, blocks=None, x=None, **kwargs):
    kwargs = {"mesh": mesh, "microbatches": 4} | kwargs
    layer = kwargs.pop("layer", _layer)
    blocks = _blocks() if blocks is None else blocks
    x = jnp.ones((16, 4)) if x is None else x
    return eqxshard.filter_pipeline(layer, blocks, x, **kwargs)


def test_layer_not_callable(mesh):
    with pytest.raises(TypeError, match=r"`layer` to be a callable `layer\(block, h\)"):
        _run(mesh, layer="dense")


def test_no_mesh_given_or_set():
    with pytest.raises(ValueError, match=r"without a `mesh` and no mesh is set"):
        _run(None)


def test_mesh_not_a_mesh():
    with pytest.raises(TypeError, match=r"`filter_pipeline\(mesh=...\)` must be a"):
        _run("stage")


def test_axis_not_in_mesh(mesh):
    with pytest.raises(ValueError, match=r"got 'pipe' and the mesh has the axes \['stage'\]"):
        _run(mesh, axis="pipe")


@pytest.mark.parametrize("name", ["microbatches", "repeats"])
def test_counts_not_ints(mesh, name):
    with pytest.raises(TypeError, match=rf"`filter_pipeline\({name}=...\)` must be an int"):
        _run(mesh, **{name: 2.0})


@pytest.mark.parametrize("name", ["microbatches", "repeats"])
def test_counts_below_one(mesh, name):
    with pytest.raises(ValueError, match=rf"`filter_pipeline\({name}=...\)` must be at least 1"):
        _run(mesh, **{name: 0})


def test_fewer_microbatches_than_stages_refused_with_the_bubble(mesh):
    with pytest.raises(ValueError, match=r"microbatches=2, fewer than the 4 stages.* 60% of"):
        _run(mesh, microbatches=2)


def test_blocks_without_arrays(mesh):
    with pytest.raises(ValueError, match=r"`blocks` with no array leaves"):
        _run(mesh, blocks={"act": jax.nn.relu})


def test_leaves_disagree_on_the_layer_dim(mesh):
    blocks = {"w": jnp.ones((8, 4, 4)), "v": jnp.ones((8, 4)), "b": jnp.ones((6, 4)), "s": 1.0}
    blocks["s"] = jnp.ones(())
    with pytest.raises(ValueError, match=r"most have 8, but these do not:") as info:
        _run(mesh, blocks=blocks)
    assert "\n  b  shape (6, 4)" in str(info.value) and "\n  s  shape ()" in str(info.value)
    assert "\n  w" not in str(info.value) and "\n  v" not in str(info.value)


def test_layers_not_divisible_by_stages_times_repeats(mesh):
    with pytest.raises(ValueError, match=r"cannot split 12 layers .* 4 stages x 2 repeats = 8"):
        _run(mesh, blocks=_blocks(12), schedule="circular", repeats=2)


def test_x_with_non_array_leaves(mesh):
    with pytest.raises(TypeError, match=r"non-array leaves:\n  mask  str"):
        _run(mesh, x={"h": jnp.ones((16, 4)), "mask": "causal"})


def test_x_not_an_array(mesh):
    with pytest.raises(TypeError, match=r"`x` to be an array or a PyTree of arrays"):
        _run(mesh, x=3.0)


def test_x_leaves_disagree_on_the_batch(mesh):
    with pytest.raises(ValueError, match=r"every leaf of `x` to have the same leading"):
        _run(mesh, x={"a": jnp.ones((16, 4)), "b": jnp.ones((8, 4))})


def test_batch_not_divisible_by_microbatches(mesh):
    with pytest.raises(ValueError, match=r"batch of `x` \(18\) into microbatches=4: 18 is"):
        _run(mesh, x=jnp.ones((18, 4)))


def test_batch_not_divisible_by_microbatches_times_data_parallel():
    mesh = make_mesh("explicit", shape=(2, 4), names=("data", "stage"))
    x = eqxshard.filter_shard(jnp.ones((12, 4)), mesh, P("data"))
    with pytest.raises(ValueError, match=r"microbatches=4 x 2 data-parallel parts: 12 is not"):
        _run(mesh, x=x)


def test_unknown_remat_policy(mesh):
    with pytest.raises(ValueError, match=r"`filter_pipeline\(remat=...\)` takes one of 'none'"):
        _run(mesh, remat="selective")


def test_offload_without_host_memory(mesh, monkeypatch):
    monkeypatch.setattr(remat, "memory_kinds", lambda device: {"device"})
    monkeypatch.setattr(_compat, "memory_kinds_in_jit", lambda: True)
    with pytest.raises(ValueError, match=r"remat='offload'.* only the memories \['device'\]"):
        _run(mesh, remat="offload")


def test_offload_where_jax_cannot_move_memory_kinds_in_jit(mesh, monkeypatch):
    monkeypatch.setattr(_compat, "memory_kinds_in_jit", lambda: False)
    with pytest.raises(ValueError, match=r"remat='offload'.* jax 0.8 and newer can"):
        _run(mesh, remat="offload")


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_microbatches_that_do_not_split_over_the_data_axis_warn(kind):
    """Batch 20 in 4 microbatches of 5 rows on `data=2`: run replicated over 'data', with
    a `FallbackWarning` naming the sizes and a batch that splits; the result is right."""
    mesh = make_mesh(kind, shape=(4, 2), names=("stage", "data"))
    x = jnp.arange(20 * 4, dtype=jnp.float32).reshape(20, 4) / 80
    ref = jax.lax.scan(lambda h, b: (_layer(b, h), None), x, _blocks())[0]
    with pytest.warns(
        eqxshard.FallbackWarning,
        match=r"replicated over the mesh's data axes 'data' \(2\): the batch of 20 cut into "
        r"microbatches=4 gives microbatches of 5 rows.* divisible by microbatches x data = 8 "
        r"\(e\.g\. 24\)",
    ):
        y = _run(mesh, x=x)
    assert jnp.allclose(y, ref, atol=1e-6)


def test_microbatches_that_split_over_the_data_axis_do_not_warn():
    mesh = make_mesh("auto", shape=(4, 2), names=("stage", "data"))
    _run(mesh, x=jnp.ones((24, 4)), microbatches=4)  # rows of 6: split over data=2
    # A mesh axis not named for data (a layer's "model" axis) never splits the batch.
    model = make_mesh("auto", shape=(4, 2), names=("stage", "model"))
    _run(model, x=jnp.ones((20, 4)), microbatches=4)
