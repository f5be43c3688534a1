"""kvray's server side: the block pools, the index shards and the reconciler (Ray actors).

Every one is a named, detached actor in Ray's namespace ``kvray`` that Ray restarts when it
dies; :func:`detached` gives the options they share.
"""

from __future__ import annotations

from typing import Any

from kvray.meta.messages import RAY_NAMESPACE

__all__ = ["detached"]


def detached(name: str, max_concurrency: int, **options: Any) -> dict[str, Any]:
    """Options of a kvray actor: named ``name`` in Ray's namespace ``kvray``, detached, got if
    it exists, restarted (and its calls retried) when it dies, on no CPU, without Ray's task
    events (kvray's actors take hundreds of small calls a second), plus ``options``."""
    return {
        "name": name,
        "namespace": RAY_NAMESPACE,
        "lifetime": "detached",
        "get_if_exists": True,
        "num_cpus": 0,
        "max_restarts": -1,
        "max_task_retries": -1,
        "max_concurrency": max_concurrency,
        "enable_task_events": False,
        **options,
    }
