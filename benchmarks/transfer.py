"""Host NumPy to an accelerator: eqxshard's staged transfers against `jax.device_put`.

Three trees go from host NumPy to the first device, by `eqxshard.filter_put(tree, device)`
(big leaves cut into parts and staged through pinned host memory, see `EQXSHARD_STAGING`)
and by the hand-written batched `jax.device_put(tree, device)`:

- one big leaf of `--mb` MB (float32);
- a model of 72 leaves, 0.8 x `--mb` MB in all;
- the placement benchmark's 48 `eqx.nn.MLP(64, 64, 64, 4)`: 480 small leaves.

Every ratio compares medians from this one run (interleaved), and each result is checked
to be bit-identical to `jax.device_put`'s. The targets are for a GPU such as an H100:
one big leaf >= 3x `jax.device_put`'s speed, the 72-leaf model >= 1.4x, small trees no
slower. On a machine without an accelerator the staged path is not used (CPU devices
keep `device_put`, which may not copy at all); `--staging-on-cpu` forces it there, to
check that it runs and gives the same bits (its times say nothing about a GPU).

    python benchmarks/transfer.py [--mb 1024] [--repeats 10] [--staging-on-cpu] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

if "JAX_NUM_CPU_DEVICES" not in os.environ:  # as the other benchmarks (no effect on GPUs)
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402

import eqxshard  # noqa: E402


def trees(megabytes: float) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    big = rng.standard_normal(int(megabytes * 2**20) // 4, dtype=np.float32)
    per_leaf = int(0.8 * megabytes * 2**20) // 4 // 72
    model = [rng.standard_normal(per_leaf, dtype=np.float32) for _ in range(72)]
    mlp = eqx.nn.MLP(64, 64, 64, 4, key=jax.random.key(0))
    small = [jax.tree.map(lambda x: np.asarray(x) if eqx.is_array(x) else x, mlp)] * 48
    return {
        f"one leaf, {megabytes:g} MB": [big],
        f"72 leaves, {0.8 * megabytes:g} MB": model,
        "480 small leaves (48 MLPs)": small,
    }


def by_hand(tree: Any, device: jax.Device) -> Any:
    """The batched `jax.device_put` a user would write: the array leaves in one call."""
    leaves, treedef = jax.tree.flatten(tree)
    where = [i for i, x in enumerate(leaves) if eqx.is_array(x)]
    for i, x in zip(where, jax.device_put([leaves[i] for i in where], device), strict=True):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def same_bits(a: Any, b: Any) -> bool:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(
        x.sharding == y.sharding and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in pairs
        if eqx.is_array(x)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=1024, help="size of the big leaf, MB")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--staging-on-cpu", action="store_true", help="force staging on CPU")
    parser.add_argument("--quick", action="store_true", help="8 MB, 2 repeats, forced on CPU")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.repeats, args.staging_on_cpu = 8, 2, True
    device = jax.devices()[0]
    if args.staging_on_cpu and device.platform == "cpu":
        os.environ["EQXSHARD_STAGING"] = "on"
    staged = device.platform != "cpu" or os.environ.get("EQXSHARD_STAGING") == "on"
    print(
        f"eqxshard {eqxshard.__version__} transfer benchmark: jax {jax.__version__}, "
        f"{device.device_kind} ({device.platform}); staging "
        f"{'on' if staged else 'not used (CPU)'}, EQXSHARD_STAGING_BYTES="
        f"{os.environ.get('EQXSHARD_STAGING_BYTES', 'default')}; medians of {args.repeats}."
    )
    if device.platform == "cpu":
        print("No accelerator here: these times are CPU copies, not a GPU figure.")
    targets = [1 / 3, 1 / 1.4, 1.0]
    header = (
        f"{'tree':<32} {'eqxshard':>10} {'device_put':>10} {'ratio':>6} {'target':>8}  same bits"
    )
    print(header)
    print("-" * len(header))
    for (name, tree), target in zip(trees(args.mb).items(), targets, strict=True):
        calls = {
            "eqxshard": lambda tree=tree: eqxshard.filter_put(tree, device),
            "device_put": lambda tree=tree: by_hand(tree, device),
        }
        identical = same_bits(calls["eqxshard"](), calls["device_put"]())
        times: dict[str, list[float]] = {k: [] for k in calls}
        for r in range(args.repeats):
            for key in list(calls)[r % 2 :] + list(calls)[: r % 2]:
                times[key].append(timed(calls[key]))
        ours, theirs = (statistics.median(times[k]) for k in calls)
        verdict = (
            ("PASS" if ours / theirs <= target else "MISS") if device.platform != "cpu" else ""
        )
        print(
            f"{name:<32} {ours * 1e3:>7.2f} ms {theirs * 1e3:>7.2f} ms {ours / theirs:>5.2f}x "
            f"{'<= ' + format(target, '.2f') + 'x':>8}  {'yes' if identical else 'NO'} {verdict}"
        )


if __name__ == "__main__":
    main()
