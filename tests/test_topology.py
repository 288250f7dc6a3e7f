"""`auto_plan(devices_per_node=)`: the axes that cross nodes (as `jax.make_mesh` lays the
devices out) get the `inter_node` link unless `links=` names them; `host` is PCIe."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxshard
from eqxshard._plans.auto.dimensions.data_fsdp_tensor import factorisations, mesh_shape
from eqxshard._plans.auto.meshes import mesh_for
from eqxshard._plans.auto.rank import topology

LINKS = eqxshard.links.LINKS
OPTIMIZER = optax.adamw(1e-2)
BATCH = (jax.ShapeDtypeStruct((16, 128), jnp.float32),) * 2


def step(model, opt_state, batch):
    x, y = batch
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def auto_plan(**kwargs):
    model = eqx.nn.MLP(128, 128, 256, 1, key=jax.random.key(0))
    options: dict[str, Any] = dict(devices=8, budget="1MiB", optimizer=OPTIMIZER, progress=False)
    return eqxshard.auto_plan(step, model, BATCH, **(options | kwargs))


def _crossing_on_the_mesh(shape: dict[str, int], per_node: int) -> set[str]:
    """The axes along which the real mesh's devices change node (node = id // per_node)."""
    mesh = mesh_for(shape)
    nodes = np.vectorize(lambda d: d.id // per_node)(mesh.devices)
    out = set()
    for i, axis in enumerate(shape):
        if shape[axis] > 1 and (np.diff(nodes, axis=i) != 0).any():
            out.add(axis)
    return out


@pytest.mark.parametrize("per_node", [1, 2, 4, 8])
def test_crossing_axes_are_those_of_make_mesh(per_node):
    assert [d.id for d in jax.devices()] == list(range(8))
    for sizes in factorisations(8):
        shape = mesh_shape(sizes)
        assert set(topology.crossing(shape, per_node)) == _crossing_on_the_mesh(shape, per_node)


def test_which_axes_get_which_link():
    shape = {"data": 4, "fsdp": 2, "model": 2}
    assert topology.crossing(shape, 16) == ()
    assert topology.crossing(shape, 8) == ("data",)
    assert topology.crossing(shape, 2) == ("data", "fsdp")
    assert topology.crossing(shape, 1) == ("data", "fsdp", "model")
    links = topology.axis_links(shape, {}, 4)
    assert links == {
        "data": LINKS["inter_node"],
        "fsdp": LINKS["intra_node"],
        "model": LINKS["intra_node"],
        "host": LINKS["pcie5"],
    }
    given = topology.resolve({"data": "nvlink3", "host": "pcie4"}, ("data", "fsdp", "model"))
    links = topology.axis_links(shape, given, 1)
    assert links["data"] == LINKS["nvlink3"] and links["host"] == LINKS["pcie4"]
    assert links["fsdp"] == links["model"] == LINKS["inter_node"]
    one = topology.axis_links(shape, topology.resolve("pcie4", tuple(shape)), 1)
    assert one == dict.fromkeys(shape, LINKS["pcie4"]) | {"host": LINKS["host"]}
    assert LINKS["host"] == LINKS["pcie5"]


@pytest.mark.heavy  # searches: the arithmetic is the same on every JAX
def test_nodes_slow_the_axes_that_cross_them():
    one_node = auto_plan()
    two_per_node = auto_plan(devices_per_node=2)
    again = auto_plan(devices_per_node=2, links={"data": "intra_node", "fsdp": "intra_node"})
    for a in two_per_node.table:
        if a.time is None or not a.collectives:
            continue
        (b,) = [c for c in one_node.table if c.name == a.name and c.mesh_shape == a.mesh_shape]
        (c,) = [c for c in again.table if c.name == a.name and c.mesh_shape == a.mesh_shape]
        crosses = topology.crossing(a.mesh_shape, 2)
        assert crosses  # every mesh of 8 devices has an axis over more than 2
        assert (a.communication_time or 0) > (b.communication_time or 0)
        if set(crosses) <= {"data", "fsdp"}:
            assert c.communication_time == pytest.approx(b.communication_time)
    # All 8 on one node is the default.
    same = auto_plan(devices_per_node=8)
    assert [c.time for c in same.table] == [c.time for c in one_node.table]
    assert math.isclose(one_node.chosen.time or 0, same.chosen.time or 0)


@pytest.mark.parametrize(
    "value, error, match",
    [
        (0, ValueError, r"`devices_per_node` >= 1 dividing the device count 8, but got 0"),
        (3, ValueError, r"`devices_per_node` >= 1 dividing the device count 8, but got 3"),
        ("8", TypeError, r"`devices_per_node` as an int \(e.g. 8\) or None, but got str"),
        (True, TypeError, r"`devices_per_node` as an int .* but got bool"),
    ],
)
def test_bad_devices_per_node(value, error, match):
    with pytest.raises(error, match=match):
        auto_plan(devices_per_node=value)


def test_unknown_link_axis_names_host():
    # `stage` is an axis too (pipeline candidates); `pipe` is not.
    with pytest.raises(
        ValueError, match=r"names axes \['pipe'\]; the axes are .*'stage'\] and 'host'"
    ):
        auto_plan(links={"pipe": "pcie4"})
