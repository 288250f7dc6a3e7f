"""Tensor-parallel training of a small transformer with eqxshard (plus data parallelism).

The mesh has two axes: "data" (2) splits each batch, "model" (4) splits the attention
heads and the MLP hidden units (Megatron-style: query/key/value and the MLP's first layer
split by output, the attention output and the MLP's second layer split by input). The
layout is written once with the model's own axis names ("heads", "mlp", "embed") and
mapped to mesh axes with `eqxshard.logical`. The per-device memory table is printed
before anything is allocated.

    python examples/train_tensor_parallel.py
"""

import os
import sys

import jax

# A demo on one CPU: split it into 8 devices (JAX_NUM_CPU_DEVICES=n for another count).
# This must run before JAX starts its backends. GPUs and TPUs are not affected: the
# script uses every device it finds.
if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

# The model, its loss and the synthetic data are the same in the FSDP example
# (train_fsdp.py); they live in _transformer.py, next to this script.
from _transformer import Transformer, loss_fn, make_batch  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import eqxshard  # noqa: E402

STEPS, BATCH, LEARNING_RATE = 60, 32, 3e-3

# EQXSHARD_EXAMPLE_STEPS=n runs n steps instead (the tests use a few, on 1, 2 and 8
# devices); the learning check needs the full run.
FULL_STEPS = STEPS
STEPS = int(os.environ.get("EQXSHARD_EXAMPLE_STEPS", STEPS))


def main() -> int:
    # Auto axes: XLA inserts the collectives between the split layers by itself.
    # "model" gets up to 4 devices (the 4 heads split evenly), "data" the rest: (2, 4) on 8
    # devices, (1, 2) on 2, (1, 1) on 1.
    n = jax.device_count()
    model_size = max(k for k in (1, 2, 4) if n % k == 0)
    mesh = jax.make_mesh(
        (n // model_size, model_size), ("data", "model"), axis_types=(AxisType.Auto,) * 2
    )
    print(f"{n} devices, mesh {dict(mesh.shape)}")
    # The layout in the model's terms. eqx.nn.Linear weights are (out, in).
    layout = eqxshard.path_rules(
        [
            (r".*attention\.(query|key|value)_proj\.weight", P("heads", "embed")),
            (r".*attention\.output_proj\.weight", P("embed", "heads")),
            (r".*mlp_up\.weight", P("mlp", "embed")),
            (r".*mlp_up\.bias", P("mlp")),
            (r".*mlp_down\.weight", P("embed", "mlp")),
            (r".*", P()),  # embeddings, norms, other biases: replicated
        ]
    )
    # ... and which mesh axis each name uses in this run ("embed" is not split).
    rule = eqxshard.logical(layout, {"heads": "model", "mlp": "model", "embed": None})

    # The plan, before anything is allocated: the model is only abstract here.
    abstract = eqx.filter_eval_shape(Transformer, jax.random.key(0))
    print(eqxshard.describe(abstract, mesh, rule))

    # Built directly in its sharded layout; the optimiser state likewise follows it.
    model = eqxshard.filter_init(Transformer, mesh, rule)(jax.random.key(0))
    optimiser = optax.adam(LEARNING_RATE)
    params = eqx.filter(model, eqx.is_array)
    opt_state = eqxshard.filter_init(optimiser.init, mesh, eqxshard.like(params))(params)

    # The batch split over "data"; the parameters and the state kept in their planned
    # layout (the old ones donated: their buffers hold the new ones); the loss replicated.
    @eqxshard.filter_jit(
        in_shardings=(None, None, P("data")),
        out_shardings=(rule, eqxshard.like(params), P()),
        donate=(True, True, False),
        mesh=mesh,
    )
    def train_step(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    rng = np.random.default_rng(0)
    losses = []
    for step in range(STEPS):
        model, opt_state, loss = train_step(model, opt_state, make_batch(rng, BATCH))
        losses.append(float(loss))
        if step % 10 == 0 or step == STEPS - 1:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")

    weight = model.blocks[0].attention.query_proj.weight
    assert isinstance(weight.sharding, NamedSharding)
    print(
        f"blocks.0.attention.query_proj.weight {weight.shape} is laid out as {weight.sharding.spec}"
    )
    first, final = losses[0], losses[-1]
    if STEPS < FULL_STEPS:
        print(f"learning check skipped: {STEPS} of {FULL_STEPS} steps; final loss {final:.4f}")
        return 0
    if not final < first / 2:
        print(f"FAILED: final loss {final:.4f} is not below half the first {first:.4f}")
        return 1
    print(f"final loss {final:.4f} < first loss {first:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
