"""The block pool: one actor per node, holding KV blocks in that node's Ray object store.

Write path (measured in ``scripts/bench_store.py``; see the README): a client ``ray.put``s a
*segment* (a list of up to ``segment_bytes`` of block arrays, one Ray object) and hands the ref
to its node's pool; the pool maps it zero-copy, keeps only blocks it does not hold yet and
re-``put``s them as one object of its own. That second copy is the price of ownership: an object
is owned by the process that ``put`` it, and a vLLM worker that exits would take its objects
with it (Ray >= 2.56 has no ``_owner=``). Producer and pool copies run in different processes,
so a stream of puts pipelines them. Segments are the unit of eviction (LRU by last use), so
memory accounting is exact: ``used`` is the sum of the pool's own objects and never exceeds
``capacity``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import ray
from ray import ObjectRef

from kvray.actors.types import (
    RAY_NAMESPACE,
    BlockLoc,
    Inventory,
    LeaseReply,
    PutResult,
    index_name,
)
from kvray.metrics import PoolMetrics

logger = logging.getLogger(__name__)


@dataclass
class _Segment:
    ref: ObjectRef
    nbytes: int
    keys: list[bytes]
    live: int
    leases: int = 0


@dataclass
class _Lease:
    seg_ids: list[int]
    expires: float


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0
    lost: int = 0
    stored: int = 0
    duplicates: int = 0
    stored_bytes: int = 0
    served_bytes: int = 0
    puts: int = 0
    leases: int = 0


class BlockPool:
    """Capacity-bounded, LRU-evicting block store of one node (a threaded Ray actor)."""

    def __init__(
        self,
        namespace: str,
        node_id: str,
        capacity: int,
        lease_timeout_s: float = 60.0,
        get_timeout_s: float = 30.0,
    ) -> None:
        self._namespace = namespace
        self._node_id = node_id
        self._capacity = int(capacity)
        self._lease_timeout_s = lease_timeout_s
        self._get_timeout_s = get_timeout_s
        self._incarnation = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._blocks: dict[bytes, BlockLoc] = {}
        self._segments: OrderedDict[int, _Segment] = OrderedDict()  # LRU first
        self._reserved = 0  # bytes promised to puts whose copy is in flight
        self._used = 0
        self._seg_ids = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._leases: dict[int, _Lease] = {}
        self._version = 0
        self._counters = _Counters()
        self._index: Any = None
        self._metrics = PoolMetrics(namespace, node_id)
        self._metrics.capacity(self._capacity)
        # Ray drops a gauge from the Prometheus endpoint ~20 s after its last set; an idle
        # pool must keep reporting its bytes and capacity.
        self._gauges = threading.Thread(target=self._refresh_gauges, daemon=True)
        self._gauges.start()
        logger.info("kvray pool %s on node %s: capacity %d bytes", namespace, node_id[:8], capacity)

    def _refresh_gauges(self) -> None:
        while True:
            time.sleep(5.0)
            self._metrics.capacity(self._capacity)
            self._metrics.used(self._used)

    # ------------------------------------------------------------------ writes
    def put_segment(
        self,
        keys: list[bytes],
        sizes: list[int],
        checksums: list[int],
        payload: list[ObjectRef],
    ) -> PutResult:
        """Take ownership of the new blocks of one client segment.

        ``payload`` is a one-element list so Ray hands us the ref instead of resolving it: we
        read it zero-copy and copy only the blocks we keep.
        """
        t0 = time.perf_counter()
        if not (len(keys) == len(sizes) == len(checksums)):
            raise ValueError("put_segment: keys, sizes and checksums differ in length")
        with self._lock:
            self._expire_leases()
            chosen: list[int] = []
            duplicate = 0
            seen: set[bytes] = set()
            for i, k in enumerate(keys):
                if k in self._blocks or k in seen:
                    duplicate += 1
                else:
                    chosen.append(i)
                    seen.add(k)
            need = sum(sizes[i] for i in chosen)
            evicted = self._make_room(need)
            free = self._capacity - self._used - self._reserved
            if need > free:
                # Keep the longest run of blocks (in order: a prefix chain) that fits.
                kept: list[int] = []
                total = 0
                for i in chosen:
                    if total + sizes[i] > free:
                        break
                    kept.append(i)
                    total += sizes[i]
                chosen, need = kept, total
            refused = len(keys) - duplicate - len(chosen)
            self._reserved += need
            self._counters.refused += refused
            self._counters.duplicates += duplicate
            if evicted:
                self._publish([], evicted)
        if refused:
            self._metrics.refused(refused)
        if not chosen:
            with self._lock:
                self._reserved -= need
            return PutResult(0, duplicate, refused)
        try:
            arrays = ray.get(payload[0], timeout=self._get_timeout_s)
            own = [arrays[i] for i in chosen]
            for i, a in zip(chosen, own, strict=True):
                if a.nbytes != sizes[i]:
                    raise ValueError(f"put_segment: block {i} has {a.nbytes} bytes, not {sizes[i]}")
            ref = ray.put(own)
            del arrays, own
        except Exception:
            with self._lock:
                self._reserved -= need
                self._counters.refused += len(chosen)
            self._metrics.refused(len(chosen))
            logger.exception("kvray pool: put of %d blocks failed", len(chosen))
            return PutResult(0, duplicate, refused + len(chosen))
        with self._lock:
            self._reserved -= need
            seg_id = next(self._seg_ids)
            seg_keys = [keys[i] for i in chosen]
            stored_keys: list[bytes] = []
            for pos, i in enumerate(chosen):
                k = keys[i]
                if k in self._blocks:  # a concurrent put won the race; keep the first copy
                    seg_keys[pos] = b""
                    continue
                self._blocks[k] = BlockLoc(seg_id, pos, sizes[i], checksums[i])
                stored_keys.append(k)
            self._segments[seg_id] = _Segment(ref, need, seg_keys, live=len(stored_keys))
            self._used += need
            self._counters.stored += len(stored_keys)
            self._counters.duplicates += len(chosen) - len(stored_keys)
            self._counters.stored_bytes += need
            self._counters.puts += 1
            if not stored_keys:
                self._drop_segment(seg_id)
            self._publish(stored_keys, [])
            used = self._used
        self._metrics.stored(len(stored_keys), need, time.perf_counter() - t0, used)
        return PutResult(len(stored_keys), duplicate + len(chosen) - len(stored_keys), refused)

    def _make_room(self, need: int) -> list[bytes]:
        """Evict unleased segments, least recently used first, until ``need`` bytes fit."""
        evicted: list[bytes] = []
        if need <= self._capacity - self._used - self._reserved:
            return evicted
        for seg_id in list(self._segments):
            seg = self._segments[seg_id]
            if seg.leases:
                continue
            gone = [k for k in seg.keys if k and self._holds(k, seg_id)]
            for k in gone:
                del self._blocks[k]
            evicted.extend(gone)
            self._counters.evictions += len(gone)
            self._metrics.evicted(len(gone))
            self._drop_segment(seg_id)
            if need <= self._capacity - self._used - self._reserved:
                break
        return evicted

    def _holds(self, key: bytes, seg_id: int) -> bool:
        loc = self._blocks.get(key)
        return loc is not None and loc.seg_id == seg_id

    def _drop_segment(self, seg_id: int) -> None:
        seg = self._segments.pop(seg_id)
        self._used -= seg.nbytes
        self._metrics.used(self._used)

    # ------------------------------------------------------------------ reads
    def lease(self, keys: list[bytes]) -> LeaseReply:
        """Locate blocks and protect their segments from eviction until released."""
        with self._lock:
            self._expire_leases()
            reply = LeaseReply.empty(next(self._lease_ids), len(keys))
            found = 0
            for i, k in enumerate(keys):
                loc = self._blocks.get(k)
                if loc is None:
                    continue
                found += 1
                reply.seg_ids[i] = loc.seg_id
                reply.positions[i] = loc.pos
                reply.nbytes[i] = loc.nbytes
                reply.checksums[i] = loc.checksum
                if loc.seg_id not in reply.segments:
                    seg = self._segments[loc.seg_id]
                    seg.leases += 1
                    self._segments.move_to_end(loc.seg_id)
                    reply.segments[loc.seg_id] = seg.ref
            missing = len(keys) - found
            self._counters.hits += found
            self._counters.misses += missing
            if reply.segments:
                self._leases[reply.lease_id] = _Lease(
                    list(reply.segments), time.monotonic() + self._lease_timeout_s
                )
                self._counters.leases += 1
        self._metrics.looked_up(found, missing)
        return reply

    def release_many(self, leases: list[tuple[int, int]]) -> None:
        """``release`` for a batch of ``(lease_id, served_bytes)`` (one call per reader and
        feed cycle, not one per read)."""
        served = 0
        with self._lock:
            for lease_id, nbytes in leases:
                served += nbytes
                self._release(lease_id)
            self._counters.served_bytes += served
        if served:
            self._metrics.served(served)

    def release(self, lease_id: int, served_bytes: int = 0) -> None:
        self.release_many([(lease_id, served_bytes)])

    def _release(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        for seg_id in lease.seg_ids:
            seg = self._segments.get(seg_id)
            if seg is None:
                continue
            seg.leases -= 1
            if seg.live == 0 and seg.leases == 0:
                self._drop_segment(seg_id)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for lease_id in [i for i, lease in self._leases.items() if lease.expires < now]:
            logger.warning("kvray pool: lease %d expired without release", lease_id)
            self._release(lease_id)

    def report_lost(self, keys: list[bytes], reason: str = "corrupt") -> int:
        """A reader found these blocks unusable (checksum mismatch): never serve them again."""
        dropped: list[bytes] = []
        with self._lock:
            for k in keys:
                loc = self._blocks.pop(k, None)
                if loc is None:
                    continue
                dropped.append(k)
                seg = self._segments.get(loc.seg_id)
                if seg is not None:
                    seg.live -= 1
                    seg.keys[loc.pos] = b""
                    if seg.live == 0 and seg.leases == 0:
                        self._drop_segment(loc.seg_id)
            self._counters.lost += len(dropped)
            if dropped:
                self._publish([], dropped)
        if dropped:
            logger.warning("kvray pool: dropped %d lost block(s): %s", len(dropped), reason)
            self._metrics.lost(len(dropped))
        return len(dropped)

    # ------------------------------------------------------------------ index and health
    def _publish(self, added: list[bytes], removed: list[bytes]) -> None:
        """Tell the index, fire-and-forget, in version order (called under the lock)."""
        if not added and not removed:
            return
        self._version += 1
        index = self._index_handle()
        if index is not None:
            index.update.remote(self._node_id, self._incarnation, self._version, added, removed)

    def _index_handle(self) -> Any:
        if self._index is None:
            try:
                self._index = ray.get_actor(index_name(self._namespace), namespace=RAY_NAMESPACE)
            except ValueError:
                return None  # the index resyncs from our inventory when it (re)appears
        return self._index

    def inventory(self) -> Inventory:
        with self._lock:
            return Inventory(self._node_id, self._incarnation, self._version, list(self._blocks))

    def ping(self) -> tuple[str, int]:
        with self._lock:
            return self._incarnation, self._version

    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._expire_leases()
            c = self._counters
            return {
                "node_id": self._node_id,
                "blocks": len(self._blocks),
                "bytes": self._used,
                "capacity": self._capacity,
                "segments": len(self._segments),
                "hits": c.hits,
                "misses": c.misses,
                "evictions": c.evictions,
                "refused": c.refused,
                "lost": c.lost,
                "stored": c.stored,
                "duplicates": c.duplicates,
                "stored_bytes": c.stored_bytes,
                "served_bytes": c.served_bytes,
                "puts": c.puts,
                "active_leases": len(self._leases),
            }


BlockPoolActor = ray.remote(BlockPool)


def spawn_pool(
    namespace: str,
    node_id: str,
    capacity: int,
    object_store_bytes: int | None,
    lease_timeout_s: float,
    get_timeout_s: float,
) -> Any:
    """Get or create the pool of ``node_id``: detached, pinned to its node, named.

    The capacity is clamped to 80% of the node's object store so the pool never makes Ray
    spill or refuse objects of other users.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvray.actors.types import pool_name

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
    return BlockPoolActor.options(  # type: ignore[attr-defined]
        name=pool_name(namespace, node_id),
        namespace=RAY_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=16,
        max_restarts=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(namespace, node_id, capacity, lease_timeout_s, get_timeout_s)
