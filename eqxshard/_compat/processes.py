"""Processes: gathering host data, global shapes of per-process data, the cluster JAX
detects, and the coordination service's client.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh, NamedSharding


def process_allgather(tree: Any, *, tiled: bool) -> Any:
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=tiled)


def global_shape(mesh: Mesh, spec: Any, local_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The global shape that each process's local part of `local_shape` makes on `mesh`.

    What `jax.make_array_from_process_local_data` infers. Where JAX cannot say (an
    invalid spec, or a non-uniform layout), the local size is kept: the spec checks
    or JAX then report the problem.
    """
    from jax._src import sharding_impls

    try:
        inferred = sharding_impls.local_to_global_shape(NamedSharding(mesh, spec), local_shape)
    except Exception:
        return tuple(local_shape)
    return tuple(int(g) if g is not None else d for g, d in zip(inferred, local_shape, strict=True))


def detected_cluster() -> str | None:
    """The name of the cluster `jax.distributed.initialize()` would join with no
    arguments (Slurm, Open MPI, Kubernetes, Cloud TPU pods), or `None` if it finds none.

    The same detection JAX runs itself (opt-in methods such as mpi4py excluded, as JAX
    does), read from its cluster registry: JAX has no public way to ask.
    """
    from jax._src import clusters

    for env in clusters.ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return env.__name__
    return None


# What eqxshard's cross-process checks call on the coordination-service client.
_CLIENT_METHODS = (
    "key_value_set_bytes",
    "key_value_try_get_bytes",
    "wait_at_barrier",
    "key_value_dir_get_bytes",
    "key_value_delete",
)


def coordination_client() -> Any:
    """JAX's coordination-service client (the key-value store and barriers of
    `jax.distributed`), or `None` where this JAX has none, or one without the methods
    eqxshard's cross-process checks call."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - a JAX that moved it
        return None
    client = getattr(distributed.global_state, "client", None)
    return client if all(hasattr(client, m) for m in _CLIENT_METHODS) else None


def use_gloo_address(address: str) -> bool:
    """Makes the gloo CPU collectives JAX creates for this process listen on, and tell the
    other processes, `address` (instead of what this host's name resolves to). Returns
    whether it could (`False` on a JAX that creates them elsewhere).

    JAX creates them when its CPU backend starts, with no host name: gloo then resolves
    this host's name. Call before the backend starts (JAX has no public setting).
    """
    from jax._src import xla_bridge

    owner: Any = getattr(xla_bridge, "_jax", None)
    if not hasattr(owner, "make_gloo_tcp_collectives"):  # older JAX: through xla_client
        owner = getattr(getattr(xla_bridge, "xla_client", None), "_xla", None)
    make = getattr(owner, "make_gloo_tcp_collectives", None)
    if make is None:
        return False
    make = getattr(make, "__wrapped__", make)

    def make_gloo_tcp_collectives(
        distributed_client: Any, hostname: str | None = None, interface: str | None = None
    ) -> Any:
        if hostname is None and interface is None:
            hostname = address
        return make(distributed_client=distributed_client, hostname=hostname, interface=interface)

    make_gloo_tcp_collectives.__wrapped__ = make  # pyright: ignore[reportFunctionMemberAccess]
    owner.make_gloo_tcp_collectives = make_gloo_tcp_collectives
    return True
