"""Compiling a StableHLO module lowered on an `AbstractMesh`, on as many CPU devices."""

from __future__ import annotations

import jax

# Never run: skip LLVM's optimisations (typed `dict[str, str]` by JAX, but XLA wants these
# values as an int and a bool).
# Nor constant folding (slow on big steps, and nothing here runs): as auto_plan's compiles.
_FAST: dict = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_disable_hlo_passes": "constant_folding",
}


def compile_stablehlo(
    text: str, devices: int, *, fold: bool = False
) -> tuple[dict[str, int], float, str]:
    """Compiles a StableHLO module lowered on an `AbstractMesh` of `devices` devices, on
    the first `devices` CPU devices of this process (SPMD, one partition per device):
    its `memory_analysis()` figures, flops per device, and compiled HLO text. `fold`:
    with XLA's constant folding, as `auto_plan` compiles a step whose stacks rematerialise
    (without it such a step reads about a tenth fewer bytes than it will hold).

    Private API: `jax.jit` cannot compile a module lowered without devices, so this goes
    to the backend's compiler directly, with the compile options `jit` would use.
    """
    import numpy as np
    from jax._src import compiler, xla_bridge
    from jax._src.lib import xla_client  # pyright: ignore[reportPrivateImportUsage]

    backend = xla_bridge.get_backend("cpu")
    chosen = jax.devices("cpu")[:devices]
    options = compiler.get_compile_options(
        num_replicas=1,
        num_partitions=devices,
        device_assignment=np.array(chosen).reshape(1, devices),
        env_options_overrides=(  # pyright: ignore[reportArgumentType]
            {k: v for k, v in _FAST.items() if k != "xla_disable_hlo_passes"} if fold else _FAST
        ),
    )
    options.executable_build_options.use_spmd_partitioning = True
    compile_ = getattr(backend, "compile_and_load", None)
    if compile_ is not None:
        executable = compile_(text, xla_client.DeviceList(tuple(chosen)), options)
    else:  # jax < 0.7: `compile` loads too
        executable = backend.compile(text, options)
    stats = executable.get_compiled_memory_stats()
    memory = {
        "argument_size_in_bytes": int(stats.argument_size_in_bytes),
        "output_size_in_bytes": int(stats.output_size_in_bytes),
        "alias_size_in_bytes": int(stats.alias_size_in_bytes),
        "temp_size_in_bytes": int(stats.temp_size_in_bytes),
    }
    cost = executable.cost_analysis() if hasattr(executable, "cost_analysis") else {}
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    flops = float((cost or {}).get("flops", 0.0))
    return memory, flops, executable.hlo_modules()[0].to_string()
