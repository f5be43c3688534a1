"""The block pool: one actor per node, holding KV blocks in that node's Ray object store.

Write path (measured in ``scripts/bench_store.py``; see the README): a client ``ray.put``s a
*segment* (up to ``segment_bytes`` of blocks, one Ray object: a 2D array of equal-size blocks
or a list of arrays) and hands the ref to its node's pool; the pool maps it zero-copy, keeps
only blocks it does not hold yet and re-``put``s them as one object of its own. That second
copy is the price of ownership: an object is owned by the process that ``put`` it, and a vLLM
worker that exits would take its objects with it. Segments are the unit of eviction (LRU by
last use), so ``used`` is exact: the bytes of the segments the pool holds, never above
``capacity``. A segment stays counted until its last block is evicted or dropped; readers'
zero-copy views of an evicted segment keep its memory pinned until they drop them
(:meth:`kvray.Store.get` hands out copies; :meth:`kvray.Store.fetch` views are short-lived).

Metadata is numpy throughout (about 110 bytes a block): a table from shard id
(:func:`kvray.meta.ids.shard_ids`) to (segment, position), and per segment the full keys in one
blob plus arrays of ids, shard numbers, sizes and checksums. Every read compares the full key,
so two keys whose ids collide are never confused: the second one reads as "not found".
Changes go to the index shards as versioned :class:`ShardBatch` es, one stream per shard.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray import ObjectRef

from kvray.actors.leases import Leases
from kvray.actors.publisher import PUBLISH_INTERVAL_S, IndexPublisher
from kvray.actors.segment import SegmentMeta
from kvray.actors.types import Inventory, LeaseReply, PutResult
from kvray.meta.ids import index_shard_of, shard_ids
from kvray.meta.idtable import IdTable
from kvray.metrics import PoolMetrics

logger = logging.getLogger(__name__)


@dataclass
class _Segment:
    ref: ObjectRef
    meta: SegmentMeta
    live: np.ndarray  # bool per block
    live_count: int
    leases: int = 0
    reads: int = 0


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0
    lost: int = 0
    stored: int = 0
    duplicates: int = 0
    collisions: int = 0
    stored_bytes: int = 0
    served_bytes: int = 0
    puts: int = 0
    leases: int = 0


@dataclass
class _Removed:
    ids: list[np.ndarray] = field(default_factory=list)
    shards: list[np.ndarray] = field(default_factory=list)


class BlockPool:
    """Capacity-bounded, LRU-evicting block store of one node (a threaded Ray actor)."""

    def __init__(
        self,
        namespace: str,
        node_id: str,
        slot: int,
        capacity: int,
        num_index_shards: int = 1,
        lease_timeout_s: float = 60.0,
        get_timeout_s: float = 30.0,
        publish_interval_s: float = PUBLISH_INTERVAL_S,
        *,
        run: bool = False,
    ) -> None:
        """``run``: start the threads and metrics now (the actor); unit tests leave it off
        and call :meth:`start` if they need them."""
        self._namespace = namespace
        self._node_id = node_id
        self._slot = int(slot)
        self._capacity = int(capacity)
        self._num_shards = int(num_index_shards)
        self._lease_timeout_s = lease_timeout_s
        self._get_timeout_s = get_timeout_s
        self._publish_interval_s = publish_interval_s
        self._incarnation = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._table = IdTable({"seg": np.uint32, "pos": np.uint32})
        self._segments: OrderedDict[int, _Segment] = OrderedDict()  # LRU first
        self._reserved = 0  # bytes promised to puts whose copy is in flight
        self._used = 0
        self._seg_ids = itertools.count(1)
        self._leases = Leases(lease_timeout_s)
        self._pub = IndexPublisher(namespace, self._slot, self._incarnation, self._num_shards)
        self._counters = _Counters()
        self._metrics = PoolMetrics.disabled()
        if run:
            self.start()

    def start(self) -> None:
        """Metrics and the gauge refresher (needs Ray; unit tests may skip it)."""
        self._metrics = PoolMetrics(self._namespace, self._node_id)
        self._metrics.capacity(self._capacity)
        # Ray drops a gauge from the Prometheus endpoint ~20 s after its last set; an idle
        # pool must keep reporting its bytes and capacity.
        threading.Thread(target=self._refresh_gauges, name="kvray-gauges", daemon=True).start()
        self._pub.start(self._publish_interval_s)
        logger.info(
            "kvray pool %s slot %d on node %s: capacity %d bytes",
            self._namespace,
            self._slot,
            self._node_id[:8],
            self._capacity,
        )

    def _refresh_gauges(self) -> None:
        while True:
            time.sleep(5.0)
            self._metrics.capacity(self._capacity)
            self._metrics.used(self._used)

    # ------------------------------------------------------------------ writes
    def put_segment(
        self,
        key_blob: bytes,
        key_offsets: np.ndarray,
        ids: np.ndarray,
        shards: np.ndarray,
        nshards: np.ndarray,
        sizes: np.ndarray,
        checksums: np.ndarray,
        payload: list[ObjectRef],
    ) -> PutResult:
        """Take ownership of the new blocks of one client segment.

        ``payload`` is a one-element list so Ray hands us the ref instead of resolving it: we
        read it zero-copy and copy only the blocks we keep.
        """
        t0 = time.perf_counter()
        meta = SegmentMeta(key_blob, key_offsets, ids, shards, nshards, sizes, checksums)
        if (meta.sizes <= 0).any():
            raise ValueError("put_segment: every block must have at least one byte")
        n = len(meta)
        pids = shard_ids(meta.ids, meta.shards)
        removed = _Removed()
        with self._lock:
            self._expire_leases()
            chosen, duplicate, collided = self._new_blocks(meta, pids)
            need = int(meta.sizes[chosen].sum())
            self._make_room(need, removed)
            free = self._capacity - self._used - self._reserved
            if need > free:  # keep the longest run that fits (in order: a prefix chain)
                fits = int(np.searchsorted(np.cumsum(meta.sizes[chosen]), free, side="right"))
                chosen = chosen[:fits]
                need = int(meta.sizes[chosen].sum())
            refused = n - duplicate - collided - int(chosen.size)
            self._reserved += need
            c = self._counters
            c.refused += refused + collided
            c.duplicates += duplicate
            c.collisions += collided
            self._publish(None, removed)
        if refused + collided:
            self._metrics.refused(refused + collided)
        if not chosen.size:
            with self._lock:
                self._reserved -= need
            return PutResult(0, duplicate, refused + collided)
        try:
            own = self._copy(payload[0], meta, chosen)
        except Exception:
            with self._lock:
                self._reserved -= need
                self._counters.refused += int(chosen.size)
            self._metrics.refused(int(chosen.size))
            logger.exception("kvray pool: put of %d blocks failed", chosen.size)
            return PutResult(0, duplicate, refused + collided + int(chosen.size))
        with self._lock:
            self._reserved -= need
            stored = self._adopt(own, meta.take(chosen), pids[chosen])
            late_dups = int(chosen.size) - stored
            c = self._counters
            c.stored += stored
            c.duplicates += late_dups
            c.stored_bytes += need
            c.puts += 1
            used = self._used
        self._metrics.stored(stored, need, time.perf_counter() - t0, used)
        return PutResult(stored, duplicate + late_dups, refused + collided)

    def _new_blocks(self, meta: SegmentMeta, pids: np.ndarray) -> tuple[np.ndarray, int, int]:
        """Indices of the blocks to keep (in order), duplicates, id collisions."""
        _, first = np.unique(pids, return_index=True)
        first.sort()
        duplicate = len(meta) - int(first.size)
        slots = self._table.find(pids[first])
        held = slots >= 0
        collided = 0
        if held.any():
            cols = self._table.cols
            for i, slot in zip(first[held].tolist(), slots[held].tolist(), strict=True):
                seg = self._segments[int(cols["seg"][slot])]
                if seg.meta.key(int(cols["pos"][slot])) == meta.key(i):
                    duplicate += 1
                else:
                    collided += 1  # another key with the same id: keep the first
        return first[~held], duplicate, collided

    def _copy(self, payload: ObjectRef, meta: SegmentMeta, chosen: np.ndarray) -> Any:
        """Map the client's segment and copy the chosen blocks into an object we own."""
        arrays = ray.get(payload, timeout=self._get_timeout_s)
        if isinstance(arrays, np.ndarray) and arrays.ndim == 2:
            if arrays.shape[0] != len(meta) or (meta.sizes != arrays.shape[1]).any():
                raise ValueError("put_segment: payload shape does not match the block sizes")
            own: Any = arrays if chosen.size == len(meta) else arrays[chosen]
        else:
            if len(arrays) != len(meta):
                raise ValueError("put_segment: payload has the wrong number of blocks")
            own = [arrays[i] for i in chosen.tolist()]
            got = np.fromiter((a.nbytes for a in own), dtype=np.int64, count=len(own))
            if (got != meta.sizes[chosen]).any():
                raise ValueError("put_segment: a block's size does not match its declared size")
        ref = ray.put(own)
        del arrays, own
        return ref

    def _adopt(self, ref: ObjectRef, meta: SegmentMeta, pids: np.ndarray) -> int:
        """Register a segment we now own; returns blocks stored (a concurrent put of the same
        blocks may have won the race: those stay in the other segment)."""
        present = self._table.find(pids) >= 0
        live = ~present
        stored = int(live.sum())
        if not stored:
            return 0
        seg_id = next(self._seg_ids)
        pos = np.flatnonzero(live)
        self._table.upsert(pids[pos], seg=seg_id, pos=pos.astype(np.uint32))
        self._segments[seg_id] = _Segment(ref, meta, live, stored)
        self._used += meta.nbytes
        self._publish((meta.ids[pos], meta.shards[pos], meta.nshards[pos]), None)
        return stored

    def _make_room(self, need: int, removed: _Removed) -> None:
        """Evict unleased segments, least recently used first, until ``need`` bytes fit."""
        if need <= self._capacity - self._used - self._reserved:
            return
        for seg_id in list(self._segments):
            seg = self._segments[seg_id]
            if seg.leases:
                continue
            gone = self._forget(seg_id, seg, np.flatnonzero(seg.live), removed)
            self._counters.evictions += gone
            self._metrics.evicted(gone)
            self._drop_segment(seg_id)
            if need <= self._capacity - self._used - self._reserved:
                break

    def _forget(self, seg_id: int, seg: _Segment, pos: np.ndarray, removed: _Removed) -> int:
        """Drop blocks ``pos`` of a segment from the table; queue their removal."""
        if not pos.size:
            return 0
        meta = seg.meta
        pids = shard_ids(meta.ids[pos], meta.shards[pos])
        slots = self._table.find(pids)
        cols = self._table.cols
        mine = (slots >= 0) & (cols["seg"][slots] == seg_id)
        self._table.delete_slots(slots[mine])
        seg.live[pos] = False
        seg.live_count -= int(pos.size)
        removed.ids.append(meta.ids[pos[mine]])
        removed.shards.append(meta.shards[pos[mine]])
        return int(mine.sum())

    def _drop_segment(self, seg_id: int) -> None:
        seg = self._segments.pop(seg_id)
        self._used -= seg.meta.nbytes
        self._metrics.used(self._used)

    # ------------------------------------------------------------------ reads
    def lease(self, keys: list[bytes], ids: np.ndarray, shards: np.ndarray | int) -> LeaseReply:
        """Locate blocks (by id, then full key) and protect their segments from eviction
        until released; a key whose id matches another key's block reads as not found."""
        pids = shard_ids(np.asarray(ids, dtype=np.uint64), shards)
        with self._lock:
            self._expire_leases()
            reply = LeaseReply.empty(self._leases.next_id(), len(keys))
            slots = self._table.find(pids)
            cols = self._table.cols
            found = 0
            for i in np.flatnonzero(slots >= 0).tolist():
                seg_id = int(cols["seg"][slots[i]])
                pos = int(cols["pos"][slots[i]])
                seg = self._segments[seg_id]
                if seg.meta.key(pos) != keys[i]:
                    self._counters.collisions += 1
                    continue
                found += 1
                reply.seg_ids[i] = seg_id
                reply.positions[i] = pos
                reply.nbytes[i] = seg.meta.sizes[pos]
                reply.checksums[i] = seg.meta.checksums[pos]
                if seg_id not in reply.segments:
                    seg.leases += 1
                    seg.reads += 1
                    self._segments.move_to_end(seg_id)
                    reply.segments[seg_id] = seg.ref
            missing = len(keys) - found
            self._counters.hits += found
            self._counters.misses += missing
            if reply.segments:
                self._leases.add(reply.lease_id, list(reply.segments))
                self._counters.leases += 1
        self._metrics.looked_up(found, missing)
        return reply

    def release_many(self, leases: list[tuple[int, int]]) -> None:
        """Release a batch of ``(lease_id, served_bytes)`` (one call per reader and cycle)."""
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
        self._unlease(self._leases.pop(lease_id))

    def _unlease(self, seg_ids: list[int]) -> None:
        for seg_id in seg_ids:
            seg = self._segments.get(seg_id)
            if seg is None:
                continue
            seg.leases -= 1
            if seg.live_count == 0 and seg.leases == 0:
                self._drop_segment(seg_id)

    def _expire_leases(self) -> None:
        for seg_ids in self._leases.pop_expired():
            self._unlease(seg_ids)

    def report_lost(
        self, keys: list[bytes], ids: np.ndarray, shards: np.ndarray | int, reason: str = "corrupt"
    ) -> int:
        """A reader found these blocks unusable (checksum or size mismatch): never serve them
        again. The segment's bytes stay counted until its last block goes."""
        pids = shard_ids(np.asarray(ids, dtype=np.uint64), shards)
        removed = _Removed()
        dropped = 0
        with self._lock:
            slots = self._table.find(pids)
            cols = self._table.cols
            for i in np.flatnonzero(slots >= 0).tolist():
                seg_id = int(cols["seg"][slots[i]])
                pos = int(cols["pos"][slots[i]])
                seg = self._segments[seg_id]
                if seg.meta.key(pos) != keys[i]:
                    continue
                dropped += self._forget(seg_id, seg, np.array([pos]), removed)
                if seg.live_count == 0 and seg.leases == 0:
                    self._drop_segment(seg_id)
            self._counters.lost += dropped
            self._publish(None, removed)
        if dropped:
            logger.warning("kvray pool: dropped %d lost block(s): %s", dropped, reason)
            self._metrics.lost(dropped)
        return dropped

    # ------------------------------------------------------------------ index and health
    def _publish(
        self,
        added: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
        removed: _Removed | None,
    ) -> None:
        """Queue changes for the index shards (under the lock, so in the pool's order)."""
        if removed is not None and removed.ids:
            self._pub.removed(np.concatenate(removed.ids), np.concatenate(removed.shards))
        if added is not None:
            self._pub.added(*added)

    def inventory(self, shard: int = 0, num_shards: int = 1) -> Inventory:
        """Every block shard this pool holds whose id falls in index shard ``shard``."""
        with self._lock:
            versions = self._pub.versions()  # nothing buffered is missed by the resync
            parts = []
            for seg in self._segments.values():
                pos = np.flatnonzero(seg.live)
                if pos.size:
                    m = seg.meta
                    parts.append((m.ids[pos], m.shards[pos], m.nshards[pos]))
            version = versions[shard] if shard < len(versions) else 0
        if parts:
            ids = np.concatenate([p[0] for p in parts])
            sh = np.concatenate([p[1] for p in parts])
            nsh = np.concatenate([p[2] for p in parts])
            mine = index_shard_of(ids, num_shards) == shard
            ids, sh, nsh = ids[mine], sh[mine], nsh[mine]
        else:
            ids, sh, nsh = _EMPTY, _EMPTY.astype(np.uint16), _EMPTY.astype(np.uint16)
        return Inventory(self._slot, self._incarnation, version, ids, sh, nsh)

    def ping(self) -> tuple[int, str, tuple[int, ...]]:
        """(slot, incarnation, update version per index shard), after sending anything
        buffered: a barrier that pinged waits for every change made before the ping."""
        with self._lock:
            return self._slot, self._incarnation, self._pub.versions()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._expire_leases()
            c = self._counters
            meta_bytes = self._table.nbytes + sum(
                s.meta.meta_nbytes for s in self._segments.values()
            )
            return {
                "node_id": self._node_id,
                "slot": self._slot,
                "blocks": len(self._table),
                "bytes": self._used,
                "capacity": self._capacity,
                "segments": len(self._segments),
                "meta_bytes": int(meta_bytes),
                "hits": c.hits,
                "misses": c.misses,
                "evictions": c.evictions,
                "refused": c.refused,
                "lost": c.lost,
                "stored": c.stored,
                "duplicates": c.duplicates,
                "collisions": c.collisions,
                "stored_bytes": c.stored_bytes,
                "served_bytes": c.served_bytes,
                "puts": c.puts,
                "active_leases": len(self._leases),
                "expired_leases": self._leases.expired,
            }


_EMPTY = np.zeros(0, dtype=np.uint64)


#: The actor; created with ``run=True`` so that it starts its threads in every incarnation.
BlockPoolActor = ray.remote(BlockPool)
