"""Property: over random PyTrees, meshes and valid specs, `filter_shard` keeps every value.

`filter_get(filter_shard(tree, mesh, spec))` is `tree` exactly: the same array values and
dtypes, and the very same non-array leaves.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from helpers import MESH_KINDS, assert_placed, make_mesh
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

from eqxshard import filter_get, filter_shard

MESH_SHAPES = [(1, 8), (2, 4), (4, 2), (8, 1), (2, 2, 2)]
NAMES = ("x", "y", "z")
DIMS = (1, 2, 3, 4, 6, 8)  # 3 and 6 do not split over every axis: specs must avoid that
DTYPES = (np.float32, np.int32, np.uint8, jnp.bfloat16, np.bool_)


@st.composite
def arrays(draw):
    shape = tuple(draw(st.lists(st.sampled_from(DIMS), max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    values = np.random.default_rng(seed).integers(-50, 50, size=shape)
    host = np.asarray(values).astype(dtype)
    as_jax = draw(st.booleans())
    return jnp.asarray(host) if as_jax else host


statics = st.one_of(
    st.integers(-5, 5), st.text(max_size=4), st.sampled_from([None, jnp.tanh, "static"])
)
trees = st.recursive(
    st.one_of(arrays(), statics),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from("abcd"), children, max_size=3),
    ),
    max_leaves=6,
)


@st.composite
def spec_for(draw, shape, sizes):
    """A valid spec for `shape`: each mesh axis at most once, every split dim divisible."""
    unused = list(sizes)
    entries = []
    for dim in shape:
        axes = []
        for name in list(unused):
            parts = math.prod(sizes[a] for a in axes) * sizes[name]
            if dim % parts == 0 and draw(st.booleans()):
                axes.append(name)
                unused.remove(name)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    if entries and draw(st.booleans()):  # trailing entries may be left out
        entries = entries[: draw(st.integers(0, len(entries)))]
    return P(*entries)


@settings(max_examples=30, deadline=None)
@given(
    tree=trees,
    mesh_shape=st.sampled_from(MESH_SHAPES),
    kind=st.sampled_from(MESH_KINDS),
    in_jit=st.booleans(),
    data=st.data(),
)
def test_shard_then_get_is_identity(tree, mesh_shape, kind, in_jit, data):
    names = NAMES[: len(mesh_shape)]
    mesh = make_mesh(kind, shape=mesh_shape, names=names)
    sizes = dict(zip(names, mesh_shape, strict=True))
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    specs = {
        jax.tree_util.keystr(path): data.draw(spec_for(x.shape, sizes))
        for path, x in leaves
        if eqx.is_array(x)
    }

    def shard(t):
        return filter_shard(t, mesh, lambda path, leaf: specs[jax.tree_util.keystr(path)])

    out = eqx.filter_jit(shard)(tree) if in_jit else shard(tree)
    for path, x in jax.tree_util.tree_leaves_with_path(out):
        if eqx.is_array(x):
            assert_placed(x, NamedSharding(mesh, specs[jax.tree_util.keystr(path)]))
    back = filter_get(out)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for got, ref in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True):
        if eqx.is_array(ref):
            assert isinstance(got, np.ndarray)
            assert got.dtype == ref.dtype and got.shape == ref.shape
            np.testing.assert_array_equal(got, np.asarray(ref))
        else:
            assert got is ref
