"""Ray for the tests and benchmarks: a simulated multi-node cluster on this machine, or the Ray a
caller points at (``RAY_ADDRESS``), else a local one.

A simulated cluster is a ``ray.cluster_utils.Cluster``: a head and worker "nodes", each a real
raylet with its own object store, told apart by custom resources so that work can be pinned.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["join_or_start", "simulated_cluster"]


def simulated_cluster(
    head: dict[str, Any],
    nodes: Sequence[dict[str, Any]] = (),
    *,
    system_config: dict[str, Any] | None = None,
    connect: bool = True,
    export_address: bool = False,
) -> Any:
    """A head with ``head``'s ``Cluster.add_node`` arguments plus one node per entry of
    ``nodes``, every node up before it returns; this process connected (``connect``) and, with
    ``export_address``, ``RAY_ADDRESS`` set for the processes it starts. Returns the
    ``Cluster`` (``shutdown()`` it, after ``ray.shutdown()``)."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    head_args = dict(head)
    if system_config:
        head_args["_system_config"] = {**head_args.get("_system_config", {}), **system_config}
    cluster = Cluster(initialize_head=True, head_node_args=head_args)
    for node in nodes:
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    if connect:
        ray.init(address=cluster.address, log_to_driver=False)
    if export_address:
        os.environ["RAY_ADDRESS"] = cluster.address
    return cluster


def join_or_start(object_store_bytes: int, num_cpus: int = 2) -> str:
    """Join ``RAY_ADDRESS`` when set, else start a local Ray of ``num_cpus`` CPUs and
    ``object_store_bytes`` of object store (a no-op once connected). Returns the GCS address
    for the processes the caller starts."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        else:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                object_store_memory=object_store_bytes,
                include_dashboard=False,
                log_to_driver=False,
            )
    return ray.get_runtime_context().gcs_address
