"""`eqxshard.Experts` and the `experts(axis)` rule: the rule splits exactly the experts'
expert dim (also inside a `Stacked`) in every verb that takes a rule; the module runs as
`moe` does, eagerly, under `filter_jit` and inside a `Stacked`; a small MoE model trained
3 steps on `(data=2, expert=4)` has one device's losses and keeps its layout."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import eqxshard

D, HIDDEN, E, N = 8, 16, 8, 32
AUTO = (AxisType.Auto,) * 2


def make_layer(key, **options):
    keys = jax.random.split(key, E)
    return eqxshard.Experts(
        eqx.filter_vmap(lambda k: eqx.nn.MLP(D, D, HIDDEN, 1, key=k))(keys), **options
    )


class MoEBlock(eqx.Module):
    """A residual MoE layer: the model's own router (top-2 of a softmax), then `Experts`."""

    router: eqx.nn.Linear
    experts: eqxshard.Experts

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.router = eqx.nn.Linear(D, E, use_bias=False, key=k1)
        self.experts = make_layer(k2)

    def __call__(self, h):
        weights, indices = jax.lax.top_k(jax.nn.softmax(jax.vmap(self.router)(h)), 2)
        return h + self.experts(jax.nn.relu(h), indices, weights)


class Model(eqx.Module):
    embed: eqx.nn.Linear
    layers: eqxshard.Stacked
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(D, D, key=k1)
        self.layers = eqxshard.Stacked(eqx.filter_vmap(MoEBlock)(jax.random.split(k2, 2)))
        self.head = eqx.nn.Linear(D, 1, key=k3)

    def __call__(self, x):
        return jax.vmap(self.head)(self.layers(jax.vmap(self.embed)(x)))[:, 0]


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "expert"), axis_types=AUTO)


@pytest.fixture(scope="module")
def model():
    # Built under `jit`: eagerly, the nested `filter_vmap` of the init runs op by op (~10 s).
    return eqx.filter_jit(Model)(jax.random.key(0))


@pytest.fixture(scope="module")
def layer(model):
    """The first layer's experts, as an `Experts` of their own."""
    stacked = model.layers.blocks.experts.expert_blocks
    return eqxshard.Experts(jax.tree.map(lambda a: a[0] if eqx.is_array(a) else a, stacked))


@pytest.fixture(scope="module")
def data():
    x = jax.random.normal(jax.random.key(1), (N, D))
    return x, jnp.sin(x.sum(1))


def test_the_rule_splits_the_expert_dim_and_nothing_else(mesh, model, data):
    rule = eqxshard.experts("expert") | P()
    placed = eqxshard.filter_shard(model, mesh, rule)
    specs = {
        jax.tree_util.keystr(p): leaf.sharding.spec
        for p, leaf in jax.tree_util.tree_flatten_with_path(eqx.filter(placed, eqx.is_array))[0]
    }
    experts = {p: s for p, s in specs.items() if ".expert_blocks." in p}
    assert len(experts) == 4  # two weights and two biases, stacked over 2 layers
    # Inside the `Stacked`: the layer dim first, then the expert dim.
    assert set(experts.values()) == {P(None, "expert")}
    assert all(s == P() for p, s in specs.items() if p not in experts)
    # `describe` reads the same rule.
    table = eqxshard.describe(model, mesh, rule)
    assert "expert_blocks" in str(table) and "'expert'" in str(table)
    # The model runs eagerly (the `Stacked`'s scan around `moe`) as under `filter_jit`.
    x = data[0]
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(
            placed(x), eqxshard.filter_jit(lambda m, x: m(x))(placed, x), rtol=1e-6, atol=1e-6
        )


def test_the_rule_on_a_layer_alone_and_through_filter_init(mesh):
    layer = eqxshard.filter_init(make_layer, mesh, eqxshard.experts())(jax.random.key(0))
    assert layer.expert_blocks.layers[0].weight.sharding.spec == P("expert")
    assert layer.expert_blocks.layers[0].weight.shape == (E, HIDDEN, D)


def test_the_rule_errors(mesh, layer):
    with pytest.raises(ValueError, match=r"`experts` over the mesh axis 'experts', which the"):
        eqxshard.filter_shard(layer, mesh, eqxshard.experts("experts"))
    three = jax.make_mesh((3,), ("expert",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match=r"expert dim \(dim 0\) is not divisible by the size 3"):
        eqxshard.filter_shard(layer, three, eqxshard.experts())
    with pytest.raises(TypeError, match=r"`experts` takes `axis` as a mesh axis name"):
        eqxshard.experts(3)  # pyright: ignore[reportArgumentType]


def test_the_module_runs_as_moe_does(mesh, data, layer):
    x, _ = data
    unplaced = layer
    layer = eqxshard.filter_shard(layer, mesh, eqxshard.experts())
    weights, indices = jax.lax.top_k(jax.nn.softmax(x @ jnp.ones((D, E))), 2)
    with jax.set_mesh(mesh):
        y = layer(x, indices, weights)
        y_moe = eqxshard.moe(lambda b, h: jax.vmap(b)(h), layer.expert_blocks, x, indices, weights)
        y_jit = eqxshard.filter_jit(lambda m, x: m(x, indices, weights))(layer, x)
        # `filter_jit` lays out an unplaced layer by the rule itself.
        laid_out = eqxshard.filter_jit(
            lambda m: m, in_shardings=eqxshard.experts() | P(), mesh=mesh
        )(unplaced)
    np.testing.assert_allclose(y, y_moe, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y_jit, y, rtol=1e-6, atol=1e-6)
    assert laid_out.expert_blocks.layers[1].bias.sharding.spec == P("expert")
    capped = eqxshard.Experts(layer.expert_blocks, capacity_factor=1.0, mesh=mesh)
    y_capped, dropped = capped(x, indices, weights, return_dropped=True)
    # A flat router: every token picks experts 0 and 1. Each of the 8 devices holds 4
    # tokens; capacity ceil(1.0 * 4 * 2 / 8) = 1 keeps only its first token's choices.
    assert int(dropped) == 8 * 6
    first = np.arange(N) % 4 == 0
    np.testing.assert_allclose(y_capped[first], y[first], rtol=1e-6, atol=1e-6)
    assert not np.asarray(y_capped[~first]).any()
    assert layer.n == E


def test_a_small_moe_model_trains_as_on_one_device(mesh, model, data):
    x, y = data
    opt = optax.adam(1e-2)

    def train(mesh, spec):
        with jax.set_mesh(mesh):
            placed = eqxshard.filter_shard(model, mesh, spec)
            opt_state = opt.init(eqx.filter(placed, eqx.is_array))

            @eqxshard.filter_jit
            def step(model, opt_state, x, y):
                loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
                updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
                return eqx.apply_updates(model, updates), opt_state, loss

            losses = []
            for _ in range(3):
                placed, opt_state, loss = step(placed, opt_state, x, y)
                losses.append(float(loss))
        return placed, losses

    one = jax.make_mesh((1,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    _, reference = train(one, P())
    trained, losses = train(mesh, eqxshard.experts("expert") | P())
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert losses[-1] < losses[0]
    weight = trained.layers.blocks.experts.expert_blocks.layers[0].weight
    assert weight.sharding.spec == P(None, "expert")


def test_experts_checks_its_arguments(layer):
    blocks = layer.expert_blocks
    bad = eqx.tree_at(lambda m: m.layers[1].bias, blocks, jnp.zeros((2, D)))
    with pytest.raises(ValueError, match=r"`Experts` needs every(.|\n)*layers(\[1\]|\.1)"):
        eqxshard.Experts(bad)
    with pytest.raises(ValueError, match=r"`capacity_factor` as a number > 0"):
        eqxshard.Experts(blocks, capacity_factor=-1.0)
    with pytest.raises(TypeError, match=r"`expert` as a function"):
        eqxshard.Experts(blocks, 3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"`axis` as a mesh axis name"):
        eqxshard.Experts(blocks, axis=0)  # pyright: ignore[reportArgumentType]


def test_unsplit_experts_run_every_expert_on_every_token(mesh, data, layer):
    # `axis=None`: no mesh, no dispatch; the values of the split layer, and GShard's
    # capacity over the N tokens as one group.
    x, _ = data
    weights, indices = jax.lax.top_k(jax.nn.softmax(x @ jnp.ones((D, E))), 2)
    split = eqxshard.Experts(layer.expert_blocks, mesh=mesh)
    split = eqxshard.filter_shard(split, mesh, eqxshard.experts())
    unsplit = eqxshard.Experts(layer.expert_blocks, axis=None)
    y = eqx.filter_jit(lambda m: m(x, indices, weights))(unsplit)
    np.testing.assert_allclose(y, split(x, indices, weights), rtol=1e-6, atol=1e-6)
    # A flat router: every token picks experts 0 and 1; capacity ceil(1.0 * 32 * 2 / 8) = 8
    # keeps the first 8 tokens' choices.
    capped = eqxshard.Experts(layer.expert_blocks, axis=None, capacity_factor=1.0)
    y_capped, dropped = capped(x, indices, weights, return_dropped=True)
    assert int(dropped) == 2 * (N - 8)
    np.testing.assert_allclose(y_capped[:8], y[:8], rtol=1e-6, atol=1e-6)
    assert not np.asarray(y_capped[8:]).any()
    with pytest.raises(TypeError, match=r"`axis` as a mesh axis name, or None"):
        eqxshard.Experts(layer.expert_blocks, axis=("expert",))  # pyright: ignore[reportArgumentType]


def test_inner_and_layers_lay_out_the_experts_other_dims(model):
    mesh = jax.make_mesh((2, 4), ("stage", "expert"), axis_types=AUTO)
    with pytest.raises(ValueError, match=r"`inner` or `layers` rule that lays these leaves out"):
        eqxshard.filter_shard(model, mesh, eqxshard.experts(inner=P("expert")) | P())
    rule = eqxshard.experts("expert", layers=eqxshard.stages("stage")) | P()
    placed = eqxshard.filter_shard(model, mesh, rule)
    weight = placed.layers.blocks.experts.expert_blocks.layers[0].weight
    assert weight.sharding.spec == P("stage", "expert")
    assert "P('stage', 'expert')" in str(eqxshard.describe(model, mesh, rule))
    assert repr(rule).startswith("experts(axis='expert', layers=stages(axis='stage'")


def test_a_pipeline_of_moe_layers(model, data):
    # The `Stacked` of MoE layers pipelined over 'stage' (one layer a stage), each layer's
    # experts split over 'expert' within its stage: `experts(layers=stages(...))` lays out
    # the expert leaves `P("stage", "expert")`, `stages(path=...)` the layers' other
    # leaves. Inside a stage the tokens are split over 'expert' (the stage axis is the
    # pipeline's), and the output is one device's.
    from eqxshard._experts.module import configured

    mesh = jax.make_mesh((2, 4), ("stage", "expert"), axis_types=AUTO)
    piped = eqx.tree_at(
        lambda m: m.layers,
        model,
        eqxshard.Stacked(model.layers.blocks, axis="stage", microbatches=2),
    )
    rule = eqxshard.first(
        eqxshard.experts("expert", layers=eqxshard.stages("stage")),
        eqxshard.stages("stage", path=r"layers\.blocks\..*"),
        P(),
    )
    placed = eqxshard.filter_shard(piped, mesh, rule)
    blocks = placed.layers.blocks
    assert blocks.experts.expert_blocks.layers[0].weight.sharding.spec == P("stage", "expert")
    assert blocks.router.weight.sharding.spec == P("stage")
    table = str(eqxshard.describe(piped, mesh, rule))
    assert "P('stage', 'expert')" in table and "P('stage')" in table
    x, _ = data
    with jax.set_mesh(mesh):
        y = eqxshard.filter_jit(lambda m, x: m(x))(placed, x)
    unsplit = configured(model, axis=None, mesh=None)
    np.testing.assert_allclose(
        y, eqx.filter_jit(lambda m, x: m(x))(unsplit, x), rtol=1e-5, atol=1e-6
    )
