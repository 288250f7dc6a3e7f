"""Fully sharded data-parallel (FSDP) training of a small transformer with eqxshard.

Every parameter and every optimiser moment is split over the mesh axis "data" (each
device holds 1/8 of each large leaf); each batch is split over "data" too. The model is
created directly in that layout (no device ever holds the whole model), and the
per-device memory table is printed before anything is allocated.

    python examples/train_fsdp.py
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

# The model, its loss and the synthetic data are the same in the tensor-parallel example
# (train_tensor_parallel.py); they live in _transformer.py, next to this script.
from _transformer import Transformer, loss_fn, make_batch  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import eqxshard  # noqa: E402

STEPS, BATCH, LEARNING_RATE = 60, 32, 3e-3

# EQXSHARD_EXAMPLE_STEPS=n runs n steps instead (the tests use a few, on 1, 2 and 8
# devices); the learning check needs the full run.
FULL_STEPS = STEPS
STEPS = int(os.environ.get("EQXSHARD_EXAMPLE_STEPS", STEPS))


def main() -> int:
    # Auto axes: XLA inserts the all-gathers of the parameters and the reduce-scatters of
    # the gradients by itself.
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    print(f"{jax.device_count()} devices, mesh {dict(mesh.shape)}")
    # Every leaf of at least 256 elements split along its largest dim divisible by the
    # number of devices (8 on the CPU demo);
    # smaller ones (layer norms, biases) replicated.
    rule = eqxshard.fsdp("data", min_size=256)

    # The plan, before anything is allocated: the model is only abstract here.
    abstract = eqx.filter_eval_shape(Transformer, jax.random.key(0))
    print(eqxshard.describe(abstract, mesh, rule))

    # Built directly in its sharded layout; the optimiser state likewise follows it.
    model = eqxshard.filter_init(Transformer, mesh, rule)(jax.random.key(0))
    optimiser = optax.adam(LEARNING_RATE)
    params = eqx.filter(model, eqx.is_array)
    opt_state = eqxshard.filter_init(optimiser.init, mesh, eqxshard.like(params))(params)

    # The step's layouts in one place: the batch split over "data", the parameters and the
    # state kept in their planned layout, the loss replicated; the old parameters and
    # state donated (their buffers reused for the new ones), the batch kept.
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
        # Host NumPy in: `filter_jit` lays the batch out as `in_shardings` asks.
        model, opt_state, loss = train_step(model, opt_state, make_batch(rng, BATCH))
        losses.append(float(loss))
        if step % 10 == 0 or step == STEPS - 1:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")

    weight = model.blocks[0].mlp_up.weight
    assert isinstance(weight.sharding, NamedSharding)
    print(f"blocks.0.mlp_up.weight {weight.shape} is laid out as {weight.sharding.spec}")
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
