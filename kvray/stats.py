"""``Store.stats()``: cluster-wide figures gathered from the reconciler, index shards and pools.

Knows nothing of the client: the store hands it its namespace, how it reaches a pool and its own
figures (imports point one way: the client uses this module, never the other way round)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from kvray.cluster import get_control
from kvray.meta.messages import RAY_NAMESPACE, index_name


def gather_stats(
    ns: str,
    num_index_shards: int,
    pool_handle: Callable[[str], Any],
    client: dict[str, int],
    timeout: float,
) -> dict[str, Any]:
    """Figures of namespace ``ns``: the reconciler's, each index shard's and each pool's (its
    handle from ``pool_handle(actor name)``), their totals, and the caller's ``client``."""
    control = get_control(ns)
    ctl = ray.get(control.stats.remote(), timeout=timeout)
    shard_refs = [
        ray.get_actor(index_name(ns, i), namespace=RAY_NAMESPACE).stats.remote()
        for i in range(num_index_shards)
    ]
    pool_refs = {}
    for _slot, (node_id, _alive) in sorted(ctl["pools"].items()):
        try:
            pool_refs[node_id] = pool_handle(f"{ns}/pool/{node_id}").stats.remote()
        except Exception as e:
            pool_refs[node_id] = e
    shards = []
    for ref in shard_refs:
        try:
            shards.append(ray.get(ref, timeout=timeout))
        except Exception as e:
            shards.append({"error": f"{type(e).__name__}: {e}"})
    per_node: dict[str, dict[str, Any]] = {}
    for node_id, ref in pool_refs.items():
        try:
            per_node[node_id] = ray.get(ref, timeout=timeout)
        except Exception as e:
            per_node[node_id] = {"error": f"{type(e).__name__}: {e}"}
    totals: dict[str, int] = {}
    for s in per_node.values():
        for k, v in s.items():
            if isinstance(v, int) and not isinstance(v, bool) and k != "slot":
                totals[k] = totals.get(k, 0) + v
    good = [s for s in shards if "error" not in s]
    index = {
        "keys": sum(s["keys"] for s in good),
        "pools": max((s["pools"] for s in good), default=0),
        "bytes": sum(s["bytes"] for s in good),
        "log_entries": sum(s["log_entries"] for s in good),
        "shards": shards,
    }
    return {
        "namespace": ns,
        "index": index,
        "totals": totals,
        "nodes": per_node,
        "client": client,
    }
