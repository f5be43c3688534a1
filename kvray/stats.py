"""``Store.stats()``: cluster-wide figures gathered from the reconciler, index shards and pools."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

from kvray.actors.join import get_control
from kvray.meta.messages import RAY_NAMESPACE, index_name

if TYPE_CHECKING:
    from kvray.client import Store


def gather_stats(store: Store, timeout: float) -> dict[str, Any]:
    ns = store.config.namespace
    control = get_control(ns)
    ctl = ray.get(control.stats.remote(), timeout=timeout)
    shard_refs = [
        ray.get_actor(index_name(ns, i), namespace=RAY_NAMESPACE).stats.remote()
        for i in range(store.num_index_shards)
    ]
    pool_refs = {}
    for _slot, (node_id, _alive) in sorted(ctl["pools"].items()):
        try:
            pool_refs[node_id] = store.io.handle(f"{ns}/pool/{node_id}").stats.remote()
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
    view = store.feed.view if store.feed is not None else None
    return {
        "namespace": ns,
        "index": index,
        "totals": totals,
        "nodes": per_node,
        "client": {
            "view_keys": len(view) if view is not None else 0,
            "view_bytes": view.nbytes if view is not None else 0,
            "refused_inflight": store.io.refused_inflight,
            "thread_deaths": store.thread_deaths,
        },
    }
