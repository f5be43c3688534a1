"""Deploying kvray: ``start`` / ``stop``.

``start`` creates the reconciler (:mod:`kvray.actors.reconciler`: index shards, a pool on every
node) and waits for a pool per alive node; it is idempotent. ``stop`` stops the reconciler's
loop, wakes the long polls and removes every actor of the namespace.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import ray

from kvray.actors import detached
from kvray.actors.reconciler import Reconciler, ReconcilerActor, spawn_pool
from kvray.cluster import ensure_ray, get_control
from kvray.config import KVRayConfig
from kvray.errors import InvalidArgumentError, NotStartedError, StoreUnavailableError
from kvray.meta.messages import (
    RAY_NAMESPACE,
    control_name,
    index_name,
    pool_prefix,
)

if TYPE_CHECKING:
    from kvray.handles import PoolHandle

logger = logging.getLogger(__name__)

__all__ = [
    "Reconciler",
    "ReconcilerActor",
    "default_index_shards",
    "spawn_pool",
    "start",
    "stop",
]


def default_index_shards(num_nodes: int) -> int:
    """One index shard per 16 nodes (each shard ingests >= 1M block changes a second)."""
    return max(1, min(64, math.ceil(num_nodes / 16)))


def start(config: KVRayConfig | None = None, **fields: Any) -> dict[str, Any]:
    """Deploy kvray (reconciler, index shards, one pool per alive node) on the cluster.

    Calling it again is harmless: a running namespace is kept as it is (a different capacity
    is reported, not applied: stop first to change it). Returns the reconciler's stats.
    """
    # One validation path for every entry point: unknown keys (a typo) are ConfigErrors and
    # CLI-style strings ("2GiB", "false") are converted as in kv_connector_extra_config.
    cfg = KVRayConfig.from_dict({**(config or KVRayConfig()).to_dict(), **fields})
    ensure_ray(cfg.address)
    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    shards = cfg.index_shards or default_index_shards(alive)
    control = ReconcilerActor.options(  # type: ignore[attr-defined]
        **detached(control_name(cfg.namespace), 100)
    ).remote(cfg, shards, run=True)
    wait = max(cfg.get_timeout_s, 60.0)
    deadline = time.monotonic() + wait
    try:
        k, running = ray.get(control.layout.remote(), timeout=wait)
        pools = ray.get(control.reconcile.remote(), timeout=wait)
        while pools < alive and time.monotonic() < deadline:
            time.sleep(0.2)
            pools = ray.get(control.reconcile.remote(), timeout=wait)
        _wait_for_index(cfg.namespace, k, pools, deadline)
        stats: dict[str, Any] = ray.get(control.stats.remote(), timeout=cfg.get_timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise StoreUnavailableError(
            f"kvray: the reconciler in namespace {cfg.namespace!r} did not come up in time"
        ) from e
    for key in ("capacity", "disk_dir", "disk_capacity", "disk_admit_min_hits"):
        if running.get(key) != getattr(cfg, key):
            logger.warning(
                "kvray already runs in namespace %r with %s=%r (asked %r); kept as it is",
                cfg.namespace,
                key,
                running.get(key),
                getattr(cfg, key),
            )
    stats["pools"] = pools
    stats["index_shards"] = k
    logger.info(
        "kvray started in namespace %r: %d pool(s), %d index shard(s)", cfg.namespace, pools, k
    )
    return stats


def _wait_for_index(namespace: str, shards: int, pools: int, deadline: float) -> None:
    """Until every index shard vouches for ``pools`` pools (each adopts a new pool from its
    inventory, a tick or two after the reconciler names it), or ``deadline``: a ``status``
    or a lookup right after ``start`` then sees every pool the start reported. Blocks put
    meanwhile are not lost either way (a shard adopts them with the pool's inventory)."""
    try:
        handles = [
            ray.get_actor(index_name(namespace, s), namespace=RAY_NAMESPACE) for s in range(shards)
        ]
    except ValueError:  # a shard not registered yet (restarting): its own resync follows
        return
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            seen = ray.get([h.healthy_pools.remote() for h in handles], timeout=left)
        except ray.exceptions.GetTimeoutError:
            return
        if min(seen, default=pools) >= pools:
            return
        time.sleep(0.05)


def stop(namespace: str = "default", purge: bool = False) -> int:
    """Remove kvray's actors (and so the blocks they hold in RAM) from the cluster; returns the
    actors removed. Each pool first closes its disk tier (queued writes finish, its files stay
    for the next ``start`` with the same ``disk_dir``); ``purge=True`` deletes them instead:
    every segment file of the namespace on the hosts of running pools."""
    if not isinstance(purge, bool):
        raise InvalidArgumentError(f"kvray.stop: purge must be True or False, got {purge!r}")
    ensure_ray(None)
    names: list[str] = []
    try:
        control = get_control(namespace)
    except NotStartedError:
        control = None
    if control is not None:
        try:
            names = ray.get(control.shutdown.remote(), timeout=15)
            # Waiting long polls return "stopped" at once; give them a moment to get out so
            # Ray does not retry them against a dead actor.
            time.sleep(0.2)
        except Exception:
            logger.warning("kvray stop: the reconciler did not answer; removing actors anyway")
        ray.kill(control, no_restart=True)
    removed = 1 if control is not None else 0
    prefixes = (f"{namespace}/index/", pool_prefix(namespace))
    actors = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if actor.get("namespace") == RAY_NAMESPACE and (name in names or name.startswith(prefixes)):
            with contextlib.suppress(ValueError):
                actors[name] = ray.get_actor(name, namespace=RAY_NAMESPACE)
    _close_disks(
        [h for name, h in actors.items() if name.startswith(pool_prefix(namespace))], purge
    )
    for handle in actors.values():
        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=True)
            removed += 1
    return removed


#: How long ``stop`` gives pools to finish queued disk writes (or a purge) before killing them.
CLOSE_DISK_TIMEOUT_S = 30.0


def _close_disks(pools: list[PoolHandle], purge: bool) -> None:
    """Have every pool close its disk tier (and purge it) and stop its threads; a pool that
    does not answer in time is killed anyway (its queued writes are lost, never half-visible)."""
    refs = [p.stop.remote(purge, CLOSE_DISK_TIMEOUT_S - 5) for p in pools]
    deadline = time.monotonic() + CLOSE_DISK_TIMEOUT_S
    deleted = 0
    for ref in refs:
        try:
            deleted += ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except Exception as e:
            logger.warning("kvray stop: a pool did not close its disk tier: %s", e)
    if purge:
        logger.info("kvray stop: purged %d disk file(s)", deleted)
