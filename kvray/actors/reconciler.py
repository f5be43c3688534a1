"""The reconciler (``<namespace>/control``, detached, restartable) keeps a pool on every node.

A small control loop: every ``health_check_interval_s`` it lists the alive nodes, gives each a
block pool (nodes that join later too) with a *slot* (the pool's number in location codes),
pings every pool, and pushes what it saw (alive, incarnation, update versions) to every index
shard, which purges dead pools and resyncs pools that restarted or lost an update. After a
restart it recovers the slots from the pools themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from kvray.actors import detached
from kvray.actors.index import IndexShardActor
from kvray.actors.pool import BlockPoolActor
from kvray.actors.publisher import publish_interval
from kvray.config import KVRayConfig
from kvray.disk import DiskSettings
from kvray.meta.holders import MAX_POOLS
from kvray.meta.messages import (
    RAY_NAMESPACE,
    NodeInfo,
    PoolStatus,
    index_name,
    pool_name,
    pool_prefix,
)

if TYPE_CHECKING:
    from kvray.handles import IndexHandle, PoolHandle

logger = logging.getLogger(__name__)

__all__ = ["Reconciler", "ReconcilerActor", "spawn_pool"]

#: A pool whose node is gone is forgotten (its slot freed) after this long.
FORGET_DEAD_AFTER_S = 60.0
#: Consecutive pings a live pool may miss (timeouts: busy, not dead) before its blocks are
#: purged. A pool Ray reports dead, or on a node that left, is purged at the first tick.
MISSED_PINGS_BEFORE_DEAD = 3


@dataclass
class _PoolRecord:
    slot: int
    info: NodeInfo
    handle: PoolHandle
    alive: bool = False
    incarnation: str = ""
    versions: tuple[int, ...] = ()
    dead_since: float | None = None
    missed: int = 0  # consecutive ping timeouts


class Reconciler:
    """Pools on every alive node, their health, and the index shards' view of them."""

    def __init__(self, config: KVRayConfig, num_index_shards: int, *, run: bool = False) -> None:
        self._cfg = config
        self._ns = self._cfg.namespace
        self._k = num_index_shards
        self._pools: dict[str, _PoolRecord] = {}  # node id -> pool
        self._index: list[IndexHandle] = []
        self._recovered = False
        self._stopping = False
        self._ticks = 0
        #: Ticks whose push to the index shards timed out (the shards catch up next tick).
        self._push_timeouts = 0
        #: Pools found by name after a restart that could not be taken back (gone, or not
        #: answering its ping); the next tick gives their nodes a pool again.
        self._recover_skipped = 0
        self._task: asyncio.Task[None] | None = None
        self._epoch = uuid.uuid4().hex
        if run:
            self.start()

    def start(self) -> None:
        self._index = [self._index_shard(i) for i in range(self._k)]
        self._task = asyncio.get_event_loop().create_task(self._loop())

    def _index_shard(self, i: int) -> IndexHandle:
        """Get or create index shard ``i`` (detached, restarted by Ray if it crashes)."""
        return IndexShardActor.options(  # type: ignore[attr-defined]
            **detached(index_name(self._ns, i), 1000)  # long polls and pool batches
        ).remote(self._cfg, i, self._k, run=True)

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                await self.reconcile()
            except Exception:
                logger.exception("kvray reconciler: tick failed")
            await asyncio.sleep(self._cfg.health_check_interval_s)

    def layout(self) -> tuple[int, dict[str, Any]]:
        """(number of index shards, the running configuration)."""
        return self._k, self._cfg.to_dict()

    async def reconcile(self) -> int:
        """One tick; returns the number of pools that answered."""
        self._ticks += 1
        timeout = max(2.0, 3 * self._cfg.health_check_interval_s)
        try:
            nodes = await asyncio.wait_for(
                asyncio.to_thread(ray.nodes), timeout=self._cfg.get_timeout_s
            )
        except Exception as e:  # the GCS is slow or restarting: check pools, add none
            logger.warning("kvray reconciler: listing the nodes failed (%s)", type(e).__name__)
            nodes = [
                {"NodeID": nid, "Alive": r.dead_since is None} for nid, r in self._pools.items()
            ]
        alive = {n["NodeID"]: n for n in nodes if n.get("Alive", False)}
        if not self._recovered:
            await self._recover(timeout)
        now = time.monotonic()
        for node_id, rec in list(self._pools.items()):
            if node_id not in alive:
                rec.alive = False
                rec.dead_since = rec.dead_since or now
                if now - rec.dead_since > FORGET_DEAD_AFTER_S:
                    del self._pools[node_id]
        for node_id in alive:
            if node_id not in self._pools and not self._stopping:
                self._add_pool(node_id, alive[node_id])
        await self._ping([r for nid, r in self._pools.items() if nid in alive], timeout)
        statuses = {
            r.slot: PoolStatus(r.info, r.alive, r.incarnation, r.versions)
            for r in self._pools.values()
        }
        pushes = [shard.set_pools.remote(statuses) for shard in self._index]
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*pushes, return_exceptions=True), timeout
            )
        except TimeoutError:  # a restarting shard catches up next tick
            self._push_timeouts += 1
            if self._push_timeouts == 1:  # once: a slow shard would log every tick
                logger.warning(
                    "kvray reconciler: the index shards did not take the pools' status "
                    "within %.1f s (counted in stats()['index_push_timeouts'])",
                    timeout,
                )
            results = []
        for i, r in enumerate(results):
            if isinstance(r, ray.exceptions.ActorDiedError) and not self._stopping:
                logger.warning("kvray reconciler: index shard %d is gone; starting it again", i)
                self._index[i] = self._index_shard(i)
        return sum(1 for r in self._pools.values() if r.alive)

    def _add_pool(self, node_id: str, node: dict[str, Any]) -> None:
        used = {r.slot for r in self._pools.values()}
        slot = next((s for s in range(MAX_POOLS) if s not in used), None)
        if slot is None:
            logger.error(
                "kvray reconciler: %d pools already; node %s gets none", MAX_POOLS, node_id
            )
            return
        osm = int(node.get("Resources", {}).get("object_store_memory", 0))
        handle = spawn_pool(
            self._ns,
            node_id,
            slot,
            self._cfg.capacity,
            osm,
            self._k,
            self._cfg.lease_timeout_s,
            self._cfg.get_timeout_s,
            publish_interval(len(self._pools) + 1),
            DiskSettings.from_config(self._cfg),
            eviction_policy=self._cfg.eviction_policy,
            segment_bytes=self._cfg.segment_bytes,
        )
        info = NodeInfo(slot, node_id, pool_name(self._ns, node_id), self._cfg.capacity)
        self._pools[node_id] = _PoolRecord(slot, info, handle)

    async def _recover(self, timeout: float) -> None:
        """After a restart: find the pools that exist and the slots they were given."""
        self._recovered = True
        names = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        prefix = pool_prefix(self._ns)
        for entry in names:
            if entry.get("namespace") != RAY_NAMESPACE or not entry["name"].startswith(prefix):
                continue
            node_id = entry["name"][len(prefix) :]
            try:
                handle = await asyncio.to_thread(  # a GCS call: off the event loop
                    ray.get_actor, entry["name"], namespace=RAY_NAMESPACE
                )
                slot, incarnation, versions = await asyncio.wait_for(handle.ping.remote(), timeout)
            except (ValueError, TimeoutError, ray.exceptions.RayError) as e:
                # Gone since the listing (ValueError), dead or not answering: not taken back.
                self._recover_skipped += 1
                logger.warning(
                    "kvray reconciler: pool %s not recovered after a restart (%s: %s)",
                    entry["name"],
                    type(e).__name__,
                    e,
                )
                continue
            info = NodeInfo(slot, node_id, entry["name"], self._cfg.capacity)
            self._pools[node_id] = _PoolRecord(slot, info, handle, True, incarnation, versions)

    async def _ping(self, records: list[_PoolRecord], timeout: float) -> None:
        # A new pool may take a few seconds to start; a known one must answer promptly.
        async def one(r: _PoolRecord) -> None:
            wait = timeout if r.alive else self._cfg.get_timeout_s
            try:
                slot, r.incarnation, r.versions = await asyncio.wait_for(
                    r.handle.ping.remote(), wait
                )
            except Exception as e:
                slow = isinstance(e, asyncio.TimeoutError | ray.exceptions.GetTimeoutError)
                r.missed = r.missed + 1 if slow else MISSED_PINGS_BEFORE_DEAD
                if r.alive and r.missed >= MISSED_PINGS_BEFORE_DEAD:
                    logger.warning(
                        "kvray reconciler: pool %d not answering (%s)", r.slot, type(e).__name__
                    )
                    r.alive = False
                return
            r.missed = 0
            if slot != r.slot:  # an existing pool kept the slot it was created with
                r.slot = slot
                r.info = NodeInfo(slot, r.info.node_id, r.info.pool_name, r.info.capacity)
            r.alive, r.dead_since = True, None

        await asyncio.gather(*(one(r) for r in records))

    def stats(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "ticks": self._ticks,
            "index_shards": self._k,
            "index_push_timeouts": self._push_timeouts,
            "recover_skipped": self._recover_skipped,
            "pools": {r.slot: (r.info.node_id, r.alive) for r in self._pools.values()},
        }

    async def shutdown(self) -> list[str]:
        """Stop the loop and every index shard's long polls; returns the actor names."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.gather(*(s.shutdown.remote() for s in self._index)), timeout=10
            )
        return [index_name(self._ns, i) for i in range(self._k)] + [
            r.info.pool_name for r in self._pools.values()
        ]


def spawn_pool(
    namespace: str,
    node_id: str,
    slot: int,
    capacity: int,
    object_store_bytes: int | None,
    num_index_shards: int,
    lease_timeout_s: float,
    get_timeout_s: float,
    publish_interval_s: float,
    disk: DiskSettings | None = None,
    eviction_policy: str = "lru",
    segment_bytes: int = 0,
) -> PoolHandle:
    """Get or create the pool of ``node_id``: detached, pinned to its node, named.

    The capacity is clamped to 80% of the node's object store so the pool never makes Ray
    spill or refuse objects of other users. ``disk``: its disk tier (None: RAM only).
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if object_store_bytes:
        limit = int(object_store_bytes * 0.8)
        if capacity > limit:
            logger.warning(
                "kvray: capacity %d exceeds 80%% of node %s's object store; using %d",
                capacity,
                node_id[:8],
                limit,
            )
            capacity = limit
            if disk is not None:  # what is on its way to disk must fit beside it, too
                pending = max(1 << 20, min(disk.max_pending_bytes, capacity // 4))
                disk = dataclasses.replace(disk, max_pending_bytes=pending)
    return BlockPoolActor.options(  # type: ignore[attr-defined]
        **detached(
            pool_name(namespace, node_id),
            16,
            max_task_retries=0,  # Ray's default for a pool: its callers retry what they need
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ),
    ).remote(
        namespace,
        node_id,
        slot,
        capacity,
        num_index_shards,
        lease_timeout_s,
        get_timeout_s,
        publish_interval_s,
        disk,
        eviction_policy=eviction_policy,
        segment_bytes=segment_bytes,
        run=True,
    )


#: The actor; created with ``run=True`` so that it starts its threads in every incarnation.
ReconcilerActor = ray.remote(Reconciler)
