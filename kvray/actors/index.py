"""An index shard: which pools hold the blocks of one range of ids, and a change feed of it.

``index_shards`` shards split the id space (:func:`kvray.meta.ids.index_shard_of`); each pool
sends each shard its part of every change as a versioned :class:`ShardBatch` (fire-and-forget,
one stream per pool and shard). A shard applies batches to a :class:`HolderTable` (numpy, one
entry per block), appends the blocks whose location code changed to a bounded change log, and
answers long polls with numpy arrays. A version gap or a new pool incarnation makes it rebuild
that pool's entries from the pool's inventory; the reconciler (:mod:`kvray.actors.reconciler`)
tells it each tick which pools are alive and which update version each has sent, so a lost
update or a dead pool is noticed within a tick or two. The shard holds nothing the pools do not:
a restarted shard (``max_restarts``) rebuilds itself, and clients get a snapshot (new epoch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from kvray.actors.changelog import ChangeLog
from kvray.actors.engines import EngineTier
from kvray.config import KVRayConfig
from kvray.meta.holders import PLACEMENT_BASE, Diff, HolderTable
from kvray.meta.messages import (
    RAY_NAMESPACE,
    Changes,
    GhostNotice,
    Inventory,
    NodeInfo,
    PoolStatus,
    ReplicaInfo,
    ShardBatch,
)
from kvray.meta.news import ClusterNews
from kvray.metrics import IndexMetrics

if TYPE_CHECKING:
    from kvray.handles import PoolHandle

logger = logging.getLogger(__name__)

#: Batches of one pool held while an earlier one is late, and how long one may be late.
MAX_EARLY = 256
MAX_GAP_S = 2.0
#: How long after a resync a "not answering" about the pool's previous incarnation is ignored.
STALE_VERDICT_S = 10.0


@dataclass
class _Pool:
    info: NodeInfo
    handle: PoolHandle | None = None
    incarnation: str = ""
    version: int = 0
    healthy: bool = False
    resyncing: bool = False
    lag_ticks: int = 0
    #: Batches that arrived ahead of their turn, by version, and since when one has waited.
    early: dict[int, tuple[str, ShardBatch]] = field(default_factory=dict)
    early_since: float = 0.0
    #: When the last resync read this pool's inventory (monotonic seconds).
    resynced_at: float = 0.0


class IndexShard:
    """One shard of the global index (an async Ray actor)."""

    def __init__(
        self, config: KVRayConfig, shard: int = 0, num_shards: int = 1, *, run: bool = False
    ) -> None:
        self._cfg = config
        self._ns = self._cfg.namespace
        self._shard = shard
        self._num_shards = num_shards
        self._epoch = uuid.uuid4().hex
        self._holders = HolderTable()
        self._pools: dict[int, _Pool] = {}
        self._nodes_version = 0
        self._feed = ChangeLog()
        self._news = ClusterNews()  # the cluster's ghosts and copies
        self._engines = EngineTier(shard, self._feed)
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._applied = 0
        # Set (and replaced) whenever a pool's version moves or its health changes: what a
        # barrier waits for. Not the change log's event: a batch that changes no location
        # (a second copy behind the one readers read, a hidden copy's removal) records nothing.
        self._moved: asyncio.Event | None = None
        self._busy_s = 0.0  # CPU time spent applying pool updates
        self._resyncs = 0
        self._metrics = IndexMetrics.disabled()
        if run:
            self.start()

    def start(self) -> None:
        self._metrics = IndexMetrics(self._ns, self._shard)
        logger.info(
            "kvray index shard %s/%d started (epoch %s)", self._ns, self._shard, self._epoch[:8]
        )

    # ------------------------------------------------------------------ feed
    def _nodes(self) -> dict[int, NodeInfo]:
        return {slot: p.info for slot, p in self._pools.items() if p.healthy}

    def _reply(
        self,
        ids: np.ndarray,
        locs: np.ndarray,
        seq: int,
        snapshot: bool,
        engine: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> Changes:
        """``engine``: the engine tier's records (None: a reply without the engine tier)."""
        tuples = self._holders.placements.tuples
        eids, emasks = engine if engine is not None else (ids[:0], ids[:0])
        codes = np.unique(locs[locs >= PLACEMENT_BASE]).tolist() if locs.size else []
        return Changes(
            index_shard=self._shard,
            epoch=self._epoch,
            seq=seq,
            ids=ids,
            locs=locs,
            placements={c: tuples[c] for c in codes if c in tuples},
            nodes=self._nodes(),
            nodes_version=self._nodes_version,
            snapshot=snapshot,
            engine_ids=eids,
            engine_masks=emasks,
            replicas=self._engines.replicas() if engine is not None else {},
        )

    def _stopped(self) -> Changes:
        empty = np.zeros(0, dtype=np.uint64)
        return Changes(
            index_shard=self._shard,
            epoch=self._epoch,
            seq=self._feed.seq,
            ids=empty,
            locs=empty.astype(np.uint16),
            stopped=True,
        )

    async def changes(
        self, epoch: str, since: int, wait_s: float = 1.0, engine: bool = True
    ) -> Changes:
        """Records after ``since``; waits up to ``wait_s`` for one (a long poll, not a spin).
        ``engine=False``: without the engine tier (a subscriber that does not route)."""
        if self._stopping:
            return self._stopped()
        if epoch != self._epoch or since < self._feed.floor or since > self._feed.seq:
            return self._snapshot(engine)
        got = await self._feed.poll(since, wait_s, engine=engine)
        if self._stopping:
            return self._stopped()
        if got is None:
            return self._snapshot(engine)
        ids, locs, eids, emasks, seq = got
        return self._reply(ids, locs, seq, False, engine=(eids, emasks) if engine else None)

    def _snapshot(self, engine: bool = True) -> Changes:
        ids, locs = self._holders.visible()
        tier = self._engines.holders.items() if engine else None
        return self._reply(ids, locs, self._feed.seq, True, engine=tier)

    # ------------------------------------------------------------------ engine tier
    def engine_register(self, key: str, node_id: str, incarnation: str) -> int:
        """A slot for an engine that reports its cache (shard 0 gives them; -1: none free)."""
        return self._engines.register(key, node_id, incarnation)

    def engine_update(
        self, info: ReplicaInfo, add: np.ndarray, remove: np.ndarray, full: bool = False
    ) -> bool:
        """An engine's report of this shard's id range (:mod:`kvray.actors.engines`)."""
        return self._engines.update(info, add, remove, full)

    def engine_drop(self, slot: int, incarnation: str) -> None:
        self._engines.drop(slot, incarnation)

    async def barrier(self, timeout: float = 10.0, engine: bool = True) -> tuple[str, int]:
        """(epoch, seq) once every update a healthy pool sent before this call is applied
        (``engine=False``: the seq of the last CPU-tier record, what a feed without the engine
        tier reaches without waiting for later engine records).

        Pool updates are fire-and-forget, so "the index knows" lags "the pool stored" by a
        message; tools and tests that need read-your-writes across processes wait here.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pools = [p for p in self._pools.values() if p.healthy and p.handle is not None]
        pings = await asyncio.gather(
            *(asyncio.wait_for(p.handle.ping.remote(), timeout) for p in pools),
            return_exceptions=True,
        )
        for pool, ping in zip(pools, pings, strict=True):
            if isinstance(ping, BaseException):
                continue
            _, incarnation, versions = ping
            want = versions[self._shard] if self._shard < len(versions) else 0
            while pool.healthy and pool.incarnation == incarnation and pool.version < want:
                left = deadline - loop.time()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._moved_event().wait(), timeout=left)
        return self._epoch, self._feed.seq if engine else self._feed.cpu_seq

    # ------------------------------------------------------------------ updates from pools
    async def update(
        self, slot: int, incarnation: str, version: int, batch: ShardBatch
    ) -> GhostNotice | None:
        """A pool's next batch. Batches may arrive out of order (Ray does not order an async
        actor's calls): one that runs ahead waits in a small buffer for the gap to fill; a
        gap that lasts (a lost message) or a new incarnation makes the shard resync the pool.
        The answer is the cluster's news for that pool, if any (:mod:`kvray.meta.news`)."""
        self._update(slot, incarnation, version, batch)
        # Hints, not state: they do not wait for the batch's turn (the block changes do).
        return self._news.batch(slot, batch.ghosts, batch.heads, self._holders)

    def _update(self, slot: int, incarnation: str, version: int, batch: ShardBatch) -> None:
        pool = self._pools.get(slot)
        if pool is None:
            return  # not known yet: adopted from its inventory once the reconciler names it
        if pool.resyncing:  # applied after the inventory if newer than it
            if len(pool.early) < MAX_EARLY:
                pool.early[version] = (incarnation, batch)
            return
        if not pool.healthy:
            return  # a resync is due, which takes the inventory
        if incarnation != pool.incarnation:
            self._spawn_resync(slot, "new incarnation")
            return
        if version <= pool.version:
            return
        if version > pool.version + 1:
            now = time.monotonic()
            pool.early[version] = (incarnation, batch)
            pool.early_since = pool.early_since or now
            if len(pool.early) > MAX_EARLY or now - pool.early_since > MAX_GAP_S:
                self._spawn_resync(slot, "update lost")
            return
        self._apply(pool, version, batch)
        self._catch_up(pool)

    def _catch_up(self, pool: _Pool) -> None:
        """Apply the buffered batches that follow the pool's version, in order."""
        for v in [
            v for v, (inc, _) in pool.early.items() if v <= pool.version or inc != pool.incarnation
        ]:
            del pool.early[v]
        while pool.version + 1 in pool.early:  # the gap is filled
            self._apply(pool, pool.version + 1, pool.early.pop(pool.version + 1)[1])
        pool.early_since = time.monotonic() if pool.early else 0.0

    def _moved_event(self) -> asyncio.Event:
        if self._moved is None:
            self._moved = asyncio.Event()
        return self._moved

    def _wake_barriers(self) -> None:
        """A pool's version moved or its health changed: barriers look again."""
        if self._moved is not None:
            self._moved.set()
            self._moved = None

    def _apply(self, pool: _Pool, version: int, batch: ShardBatch) -> None:
        pool.version = version
        self._wake_barriers()
        t0 = time.thread_time()
        slot = pool.info.slot
        h = self._holders
        h.seq, h.reuse_floor = self._feed.seq + 1, self._feed.floor
        d1 = h.remove(slot, batch.rm_ids, batch.rm_shards)
        d2 = h.add(slot, batch.add_ids, batch.add_shards, batch.add_nshards, batch.add_unique)
        self._applied += len(batch)
        self._feed.record(
            Diff(np.concatenate((d1.ids, d2.ids)), np.concatenate((d1.locs, d2.locs)))
        )
        self._busy_s += time.thread_time() - t0

    def _spawn_resync(self, slot: int, why: str) -> None:
        task = asyncio.get_running_loop().create_task(self._resync(slot, why))
        self._tasks.add(task)  # kept until done, or it could be garbage-collected mid-run
        task.add_done_callback(self._tasks.discard)

    async def _resync(self, slot: int, why: str) -> None:
        """Replace a pool's entries with its inventory."""
        pool = self._pools.get(slot)
        if pool is None or pool.resyncing:
            return
        pool.resyncing = True
        self._resyncs += 1
        try:
            if pool.handle is None:  # a GCS call: off the event loop
                pool.handle = await asyncio.to_thread(
                    ray.get_actor, pool.info.pool_name, namespace=RAY_NAMESPACE
                )
            inv: Inventory = await asyncio.wait_for(
                pool.handle.inventory.remote(self._shard, self._num_shards),
                timeout=self._cfg.get_timeout_s,
            )
        except Exception as e:  # the pool is gone or hung: its blocks cannot be served
            pool.resyncing = False
            self._purge(pool, f"inventory failed ({why}): {type(e).__name__}")
            return
        pool.resyncing = False
        if self._pools.get(slot) is not pool:
            return  # removed meanwhile
        h = self._holders
        h.seq, h.reuse_floor = self._feed.seq + 1, self._feed.floor
        self._feed.record(h.replace(slot, inv.ids, inv.shards, inv.nshards))
        pool.incarnation, pool.version, pool.lag_ticks = inv.incarnation, inv.version, 0
        pool.resynced_at = time.monotonic()
        self._wake_barriers()
        self._catch_up(pool)  # batches sent while the inventory was on its way
        if not pool.healthy:  # the barriers were woken above
            pool.healthy = True
            self._nodes_version += 1
            self._feed.notify()
        logger.info(
            "kvray index %d: pool slot %d resynced (%s): %d blocks",
            self._shard,
            slot,
            why,
            inv.ids.size,
        )

    def _purge(self, pool: _Pool, why: str) -> None:
        """Forget everything a pool holds (it died or stopped answering)."""
        h = self._holders
        h.seq, h.reuse_floor = self._feed.seq + 1, self._feed.floor
        diff = h.purge(pool.info.slot)
        self._news.forget(pool.info.slot)
        self._feed.record(diff)
        if len(diff):
            self._metrics.purged(len(diff))
            logger.warning(
                "kvray index %d: %d blocks of node %s gone (%s)",
                self._shard,
                len(diff),
                pool.info.node_id[:8],
                why,
            )
        if pool.healthy:
            pool.healthy = False
            self._wake_barriers()
            self._nodes_version += 1
            self._feed.notify()

    @staticmethod
    def _stale_verdict(pool: _Pool, st: PoolStatus) -> bool:
        """ "Not answering" about an older incarnation than the one this shard just rebuilt
        from: the reconciler's ping went to the restarting actor. The next tick judges the new
        one; a verdict that persists past ``STALE_VERDICT_S`` purges."""
        return (
            st.incarnation != pool.incarnation
            and time.monotonic() - pool.resynced_at < STALE_VERDICT_S
        )

    # ------------------------------------------------------------------ pools (reconciler)
    async def set_pools(self, statuses: dict[int, PoolStatus]) -> None:
        """The reconciler's view of every pool, once per tick."""
        for slot in [s for s in self._pools if s not in statuses]:
            self._purge(self._pools.pop(slot), "pool removed")
        for slot, st in statuses.items():
            pool = self._pools.get(slot)
            if pool is None or pool.info != st.info:
                if pool is not None:
                    self._purge(pool, "pool replaced")
                pool = self._pools[slot] = _Pool(st.info)
            if not st.alive:
                if pool.healthy and not self._stale_verdict(pool, st):
                    self._purge(pool, "pool not answering")
                continue
            if pool.resyncing:
                continue
            if not pool.healthy or st.incarnation != pool.incarnation:
                self._spawn_resync(slot, "pool (re)started")
                continue
            sent = st.versions[self._shard] if self._shard < len(st.versions) else 0
            if sent > pool.version:
                # Updates may be in flight; two ticks without catching up means one was lost.
                pool.lag_ticks += 1
                if pool.lag_ticks >= 2:
                    self._spawn_resync(slot, "updates lost")
            else:
                pool.lag_ticks = 0
        self._engines.sweep()
        self._metrics.size(len(self._holders), sum(p.healthy for p in self._pools.values()))
        self._metrics.memory(self._nbytes(), self._feed.entries)

    # ------------------------------------------------------------------ queries
    def locate(self, ids: np.ndarray) -> np.ndarray:
        """Location code of each id (0: not visible)."""
        return self._holders.locs(np.asarray(ids, dtype=np.uint64))

    def other_holders(self, ids: np.ndarray, failed: np.ndarray) -> np.ndarray:
        """A pool slot other than ``failed[i]`` holding each block whole, or -1
        (:meth:`HolderTable.other_holder`): a reader's second try after a lost read."""
        return self._holders.other_holder(
            np.asarray(ids, dtype=np.uint64), np.asarray(failed, dtype=np.int64)
        )

    def healthy_pools(self) -> int:
        """Pools whose blocks this shard vouches for (adopted and not purged)."""
        return sum(1 for p in self._pools.values() if p.healthy)

    def current(self) -> tuple[str, int]:
        return self._epoch, self._feed.seq

    def _nbytes(self) -> int:
        return (
            self._holders.nbytes
            + self._feed.nbytes
            + self._engines.holders.nbytes
            + self._news.nbytes
        )

    def stats(self) -> dict[str, Any]:
        return {
            "shard": self._shard,
            "epoch": self._epoch,
            "seq": self._feed.seq,
            "keys": len(self._holders),
            "blocks": len(self._holders),
            "multi_holder_blocks": len(self._holders.multi),
            "placements": len(self._holders.placements),
            "pools": sum(1 for p in self._pools.values() if p.healthy),
            "log_entries": self._feed.entries,
            "applied": self._applied,
            "busy_s": self._busy_s,
            "resyncs": self._resyncs,
            "ghosts": len(self._news),
            "ghost_returns": self._news.ghosts.returns,
            "duplicate_segments": self._news.duplicates,
            "bytes": self._nbytes(),
            "rss_bytes": _rss(),
            **self._engines.stats(),
        }

    def shutdown(self) -> None:
        """Answer every long poll with ``stopped`` (before ``kvray.stop`` kills the actors)."""
        self._stopping = True
        self._feed.notify()
        self._wake_barriers()


def _rss() -> int:
    """Resident memory of this process (psutil ships with ray[default])."""
    try:
        import psutil
    except ImportError:
        return 0
    try:
        return int(psutil.Process().memory_info().rss)
    except (psutil.Error, OSError):
        return 0


#: The actor; created with ``run=True`` so that it starts its threads in every incarnation.
IndexShardActor = ray.remote(IndexShard)
