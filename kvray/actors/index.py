"""The global index: which node holds which block, for the whole cluster.

It is an async actor so that many clients can long-poll its change feed without tying up
threads. Pools tell it what they store and evict in versioned batches; a gap in a pool's
versions, a new pool incarnation, or a pool that stops answering makes the index drop that node's
entries and, once the pool answers again, rebuild them from the pool's inventory. The index holds
nothing that the pools do not, so a restarted index (``max_restarts``) rebuilds itself fully.
It also deploys pools: every health tick gives each alive node a pool (nodes that join later).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray

from kvray.actors.pool import spawn_pool
from kvray.actors.types import Changes, Inventory, NodeInfo, pool_name
from kvray.config import KVRayConfig
from kvray.metrics import IndexMetrics

logger = logging.getLogger(__name__)

#: Upper bound on keys kept in the change log; clients further behind get a snapshot.
MAX_LOG_KEYS = 2_000_000
#: Upper bound on keys in one feed answer.
MAX_REPLY_KEYS = 500_000


@dataclass
class _Node:
    slot: int
    info: NodeInfo
    handle: Any
    incarnation: str = ""
    version: int = 0
    keys: set[bytes] = field(default_factory=set)
    healthy: bool = False
    resyncing: bool = False
    lag_ticks: int = 0


class BlockIndex:
    """Key -> holder nodes, prefix matching, change feed, pool deployment and health."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._cfg = KVRayConfig.from_dict(config)
        self._ns = self._cfg.namespace
        self._epoch = uuid.uuid4().hex
        self._where: dict[bytes, int | tuple[int, ...]] = {}
        self._nodes: dict[str, _Node] = {}
        self._by_slot: dict[int, _Node] = {}
        self._slots = itertools.count(0)
        self._seq = 0
        self._log_floor = 0  # seq of the newest record dropped from the log
        self._log: deque[tuple[int, list[bytes], list[bytes]]] = deque()
        self._log_keys = 0
        self._changed = asyncio.Event()
        self._metrics = IndexMetrics(self._ns)
        self._ticks = 0
        self._stopping = False
        self._task = asyncio.get_event_loop().create_task(self._health_loop())
        logger.info("kvray index %s started (epoch %s)", self._ns, self._epoch[:8])

    # ------------------------------------------------------------------ feed
    def _record(self, slot: int, added: list[bytes], removed: list[bytes]) -> None:
        if not added and not removed:
            return
        self._seq += 1
        self._log.append((slot, added, removed))
        self._log_keys += len(added) + len(removed)
        while self._log_keys > MAX_LOG_KEYS and len(self._log) > 1:
            _, a, r = self._log.popleft()
            self._log_keys -= len(a) + len(r)
            self._log_floor += 1
        self._notify()

    def _notify(self) -> None:
        """Wake every long poll and barrier waiting for a change."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _node_table(self) -> dict[int, NodeInfo]:
        return {slot: n.info for slot, n in self._by_slot.items() if n.healthy}

    async def changes(self, epoch: str, since: int, wait_s: float = 1.0) -> Changes:
        """Changes after ``since``; waits up to ``wait_s`` for one (a long poll, not a spin)."""
        if self._stopping:
            return Changes(epoch=self._epoch, seq=self._seq, nodes={}, stopped=True)
        if epoch != self._epoch or since < self._log_floor or since > self._seq:
            return self._snapshot()
        if since == self._seq and wait_s > 0:
            event = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=wait_s)
            if self._stopping:
                return Changes(epoch=self._epoch, seq=self._seq, nodes={}, stopped=True)
            if epoch != self._epoch or since < self._log_floor:
                return self._snapshot()
        start = since - self._log_floor
        records: list[tuple[int, list[bytes], list[bytes]]] = []
        n = 0
        seq = since
        for rec in itertools.islice(self._log, start, None):
            records.append(rec)
            seq += 1
            n += len(rec[1]) + len(rec[2])
            if n >= MAX_REPLY_KEYS:
                break
        return Changes(epoch=self._epoch, seq=seq, nodes=self._node_table(), records=records)

    def _snapshot(self) -> Changes:
        records = [(n.slot, list(n.keys), []) for n in self._by_slot.values() if n.keys]
        return Changes(
            epoch=self._epoch,
            seq=self._seq,
            nodes=self._node_table(),
            snapshot=True,
            records=records,
        )

    def current(self) -> tuple[str, int]:
        return self._epoch, self._seq

    async def barrier(self, timeout: float = 10.0) -> tuple[str, int]:
        """(epoch, seq) once every update a healthy pool sent before this call is applied.

        Pool updates are fire-and-forget, so "the index knows" lags "the pool stored" by a
        message; tests and tools that need read-your-writes across processes wait here.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        nodes = [n for n in self._nodes.values() if n.healthy]
        pings = await asyncio.gather(
            *(asyncio.wait_for(n.handle.ping.remote(), timeout) for n in nodes),
            return_exceptions=True,
        )
        for node, ping in zip(nodes, pings, strict=True):
            if isinstance(ping, BaseException):
                continue
            incarnation, version = ping
            while node.healthy and node.incarnation == incarnation and node.version < version:
                left = deadline - loop.time()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=left)
        return self._epoch, self._seq

    # ------------------------------------------------------------------ queries
    def match_prefix(self, keys: list[bytes]) -> int:
        """Length of the longest prefix of ``keys`` held somewhere in the cluster."""
        where = self._where
        for i, k in enumerate(keys):
            if k not in where:
                return i
        return len(keys)

    def locate(self, keys: list[bytes]) -> list[list[str]]:
        """Holder node ids of each key (empty list when nowhere)."""
        out: list[list[str]] = []
        for k in keys:
            v = self._where.get(k)
            slots = () if v is None else (v,) if isinstance(v, int) else v
            out.append([self._by_slot[s].info.node_id for s in slots])
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "seq": self._seq,
            "keys": len(self._where),
            "pools": sum(1 for n in self._nodes.values() if n.healthy),
            "log_records": len(self._log),
            "ticks": self._ticks,
            "rss_bytes": _rss(),
            "config": self._cfg.to_dict(),
        }

    # ------------------------------------------------------------------ updates from pools
    async def update(
        self,
        node_id: str,
        incarnation: str,
        version: int,
        added: list[bytes],
        removed: list[bytes],
    ) -> None:
        node = self._nodes.get(node_id)
        if node is None or node.resyncing:
            return  # the health loop adopts unknown pools and resyncs from their inventory
        if incarnation != node.incarnation or version > node.version + 1:
            asyncio.get_event_loop().create_task(self._resync(node))
            return
        if version <= node.version or not node.healthy:
            return
        node.version = version
        self._apply(node, added, removed)

    def _apply(self, node: _Node, added: list[bytes], removed: list[bytes]) -> None:
        slot, where = node.slot, self._where
        real_added: list[bytes] = []
        for k in added:
            if k in node.keys:
                continue
            node.keys.add(k)
            real_added.append(k)
            v = where.get(k)
            if v is None:
                where[k] = slot
            elif isinstance(v, int):
                where[k] = (v, slot)
            else:
                where[k] = (*v, slot)
        real_removed: list[bytes] = []
        for k in removed:
            if k not in node.keys:
                continue
            node.keys.discard(k)
            real_removed.append(k)
            self._unmap(k, slot)
        self._record(slot, real_added, real_removed)

    def _unmap(self, k: bytes, slot: int) -> None:
        v = self._where.get(k)
        if v is None:
            return
        if isinstance(v, int):
            if v == slot:
                del self._where[k]
            return
        rest = tuple(s for s in v if s != slot)
        self._where[k] = rest[0] if len(rest) == 1 else rest

    def _purge(self, node: _Node, why: str) -> None:
        """Forget everything a node holds (its pool died or stopped answering)."""
        if node.keys:
            gone = list(node.keys)
            for k in gone:
                self._unmap(k, node.slot)
            node.keys = set()
            self._record(node.slot, [], gone)
            self._metrics.purged(len(gone))
            logger.warning(
                "kvray index: purged %d keys of node %s (%s)", len(gone), node.info.node_id[:8], why
            )
        if node.healthy:
            node.healthy = False
            self._notify()

    async def _resync(self, node: _Node) -> None:
        """Replace a node's entries with its pool's inventory."""
        if node.resyncing:
            return
        node.resyncing = True
        try:
            inv: Inventory = await asyncio.wait_for(
                node.handle.inventory.remote(), timeout=self._cfg.get_timeout_s
            )
        except Exception as e:  # the pool is gone or hung: its blocks cannot be served
            self._purge(node, f"inventory failed: {type(e).__name__}")
            return
        finally:
            node.resyncing = False
        fresh = set(inv.keys)
        gone = [k for k in node.keys if k not in fresh]
        new = [k for k in inv.keys if k not in node.keys]
        node.incarnation, node.version, node.lag_ticks = inv.incarnation, inv.version, 0
        node.healthy = True
        self._apply(node, new, gone)
        self._notify()

    # ------------------------------------------------------------------ health and deployment
    async def _health_loop(self) -> None:
        while not self._stopping:
            try:
                await self.ensure_pools()
            except Exception:
                logger.exception("kvray index: health tick failed")
            await asyncio.sleep(self._cfg.health_check_interval_s)

    async def ensure_pools(self) -> int:
        """One health tick: a pool on every alive node, dead pools purged. Returns pool count."""
        self._ticks += 1
        alive = {
            n["NodeID"]: n for n in await asyncio.to_thread(ray.nodes) if n.get("Alive", False)
        }
        for node_id, node in list(self._nodes.items()):
            if node_id not in alive:
                self._purge(node, "node is dead")
                del self._nodes[node_id]
        new = [nid for nid in alive if nid not in self._nodes]
        for node_id in new:
            osm = int(alive[node_id].get("Resources", {}).get("object_store_memory", 0))
            handle = spawn_pool(
                self._ns,
                node_id,
                self._cfg.capacity,
                osm,
                self._cfg.lease_timeout_s,
                self._cfg.get_timeout_s,
            )
            slot = next(self._slots)
            info = NodeInfo(node_id, pool_name(self._ns, node_id), self._cfg.capacity)
            n = _Node(slot, info, handle)
            self._nodes[node_id] = n
            self._by_slot[slot] = n
        await asyncio.gather(*(self._check(n) for n in list(self._nodes.values())))
        pools = sum(1 for n in self._nodes.values() if n.healthy)
        self._metrics.size(len(self._where), pools)
        return pools

    async def _check(self, node: _Node) -> None:
        if node.resyncing:
            return
        # A new pool may take a few seconds to start; a known one must answer promptly.
        timeout = (
            self._cfg.get_timeout_s
            if not node.healthy
            else max(2.0, 3 * self._cfg.health_check_interval_s)
        )
        try:
            incarnation, version = await asyncio.wait_for(
                node.handle.ping.remote(), timeout=timeout
            )
        except Exception as e:
            self._purge(node, f"ping failed: {type(e).__name__}")
            return
        if not node.healthy or incarnation != node.incarnation or version < node.version:
            await self._resync(node)
        elif version > node.version:
            # Updates may be in flight; two ticks without catching up means one was lost.
            node.lag_ticks += 1
            if node.lag_ticks >= 2:
                await self._resync(node)
        else:
            node.lag_ticks = 0

    def shutdown(self) -> list[str]:
        """Stop the health loop (before ``kvray.stop`` kills the actors); returns pool names."""
        self._stopping = True
        self._task.cancel()
        self._notify()
        return [n.info.pool_name for n in self._nodes.values()]


def _rss() -> int:
    """Resident memory of this process (psutil ships with ray[default])."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        return 0


BlockIndexActor = ray.remote(BlockIndex)
