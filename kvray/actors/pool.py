"""The block pool: one actor per node, holding KV blocks in that node's Ray object store.

Write path (measured in ``scripts/bench_store.py``; see the README): a client ``ray.put``s a
*segment* (up to ``segment_bytes`` of blocks, one Ray object: a 2D array of equal-size blocks
or a list of arrays) and hands the ref to its node's pool; the pool maps it zero-copy, keeps
only blocks it does not hold yet and re-``put``s them as one object of its own. That second
copy is the price of ownership: an object is owned by the process that ``put`` it, and a vLLM
worker that exits would take its objects with it. A small segment (sent by value, inside the call)
is kept in the pool's own memory instead, up to a bound, and made an object only when a read
needs one (:mod:`.heap`). Segments are the unit of eviction (in the
order of the ``eviction_policy``: LRU by last use by default), so ``used`` is exact: the bytes
of the segments the pool holds in RAM, never above ``capacity``. A segment stays counted until
its last block is evicted or dropped; readers' zero-copy views of an evicted segment keep its
memory pinned until they drop them (:meth:`kvray.Store.get` hands out copies;
:meth:`kvray.Store.fetch` views are short-lived).

With ``disk_dir`` set, a second tier takes what RAM evicts and brings it back when it is read
(:mod:`.tiering`, reads in :mod:`.promote`); blocks on disk stay visible to lookups and survive
restarts, and a read of one succeeds whatever RAM holds.

Blocks are tracked in :class:`~kvray.actors.poolstate.PoolState` (numpy, ~110 bytes a block).
Every read compares the full key, so two keys whose ids collide are never confused: the second
one reads as "not found". Changes go to the index shards as versioned :class:`ShardBatch` es,
one stream per shard.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import numpy as np
import ray
from ray import ObjectRef

from kvray.actors import heap, slices
from kvray.actors.leases import Held, Leases
from kvray.actors.poolstate import PoolState, Removed
from kvray.actors.publisher import PUBLISH_INTERVAL_S, IndexPublisher
from kvray.actors.tiering import Tiering
from kvray.disk import DiskSettings
from kvray.errors import InvalidArgumentError
from kvray.meta import wire
from kvray.meta.ids import index_shard_of, shard_ids
from kvray.meta.messages import GhostNotice, Inventory, LeaseReply, PutResult
from kvray.meta.segment import SegmentMeta
from kvray.metrics import PoolMetrics
from kvray.threads import SupervisedThread

logger = logging.getLogger(__name__)

#: How often the gauges are set again: Ray drops a gauge ~20 s after its last set, and an idle
#: pool must keep reporting its bytes and capacity.
GAUGE_INTERVAL_S = 5.0


class BlockPool:
    """Capacity-bounded block store of one node (a threaded Ray actor); RAM evicts in the order of
    its ``eviction_policy`` (:mod:`kvray.meta.eviction`)."""

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
        disk: DiskSettings | None = None,
        *,
        eviction_policy: str = "lru",
        segment_bytes: int = 0,
        run: bool = False,
    ) -> None:
        """``run``: start the threads, metrics and the disk tier now (the actor); unit tests
        leave it off and call :meth:`start` if they need them."""
        self._namespace = namespace
        self._node_id = node_id
        self._slot = int(slot)
        self._capacity = int(capacity)
        #: A segment sent by value is kept as segments of at most this many bytes (0: whole):
        #: the unit of eviction, so a put's reused head need not go with its one-off tail.
        self._segment_bytes = int(segment_bytes)
        self._num_shards = int(num_index_shards)
        self._lease_timeout_s = lease_timeout_s
        self._get_timeout_s = get_timeout_s
        self._publish_interval_s = publish_interval_s
        self._incarnation = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._state = PoolState(self._capacity, eviction_policy)
        self._heap = heap.HeapBudget()
        self._leases = Leases(lease_timeout_s)
        self._pub = IndexPublisher(namespace, self._slot, self._incarnation, self._num_shards)
        if self._state.shares_ghosts:
            self._pub.on_notice = self._ghost_notice
        self._metrics = PoolMetrics.disabled()
        self._tiering = (
            Tiering(disk, namespace, node_id, self._state, self._lock, self._publish, get_timeout_s)
            if disk is not None
            else None
        )
        self._disk_reported: dict[str, int] = {}
        self._gauges = SupervisedThread(
            self._refresh_gauges, "kvray-gauges", f"pool slot {slot} in {namespace!r}"
        )
        if run:
            self.start()

    def start(self) -> None:
        """Metrics, the gauge refresher, the publisher and the disk tier (its scan)."""
        self._metrics = PoolMetrics(self._namespace, self._node_id)
        self._metrics.capacity(self._capacity)
        self._pub.start(self._publish_interval_s)
        if self._tiering is not None:
            self._tiering.metrics = self._metrics
            self._tiering.reads.expire = self._expire_leases
            self._tiering.start()
        self._gauges.start()
        logger.info(
            "kvray pool %s slot %d on node %s: capacity %d bytes",
            self._namespace,
            self._slot,
            self._node_id[:8],
            self._capacity,
        )

    def _refresh_gauges(self) -> None:
        while True:
            self._metrics.capacity(self._capacity)
            self._metrics.used(self._state.used)
            self._metrics.heap(self._heap.used)
            if self._tiering is not None:
                figures = self._tiering.figures()
                self._metrics.disk(figures, self._disk_reported)
                self._disk_reported = figures
            if self._gauges.stopping.wait(GAUGE_INTERVAL_S):
                return

    @property
    def thread_deaths(self) -> int:
        """Deaths of the pool's supervised threads (gauges, publisher, disk tier)."""
        disk = self._tiering.thread_deaths if self._tiering is not None else 0
        return self._gauges.deaths + self._pub.thread_deaths + disk

    def stop(self, purge: bool = False, timeout: float = 10.0) -> int:
        """Before the pool is killed (``kvray.stop``): :meth:`close_disk`, then stop the
        publisher and the gauge thread. Returns the files deleted."""
        deleted = self.close_disk(purge, timeout)
        self._pub.stop()
        self._gauges.stop()
        return deleted

    # ------------------------------------------------------------------ writes
    def put_segment(self, meta_wire: bytes, payload: list[Any] | bytes) -> PutResult:
        """Take ownership of the new blocks of one client segment (``meta_wire``: its
        :meth:`~kvray.meta.segment.SegmentMeta.to_wire`).

        ``payload`` is a one-element list so Ray hands us the ref instead of resolving it: we
        read it zero-copy and copy only the blocks we keep. A small segment comes by value
        instead (see :data:`~kvray.meta.messages.INLINE_BYTES`): its blocks concatenated in
        one ``bytes`` (:func:`~kvray.meta.segment.payload_bytes`), or the blocks themselves.
        """
        t0 = time.perf_counter()
        meta = SegmentMeta.from_wire(meta_wire)
        if (meta.sizes <= 0).any():
            raise ValueError("put_segment: every block must have at least one byte")
        n = len(meta)
        pids = shard_ids(meta.ids, meta.shards)
        removed = Removed()
        st = self._state
        with self._lock:
            self._expire_leases()
            chosen, duplicate, collided = st.new_blocks(meta, pids)
            need = int(meta.sizes[chosen].sum())
            self._metrics.evicted(st.make_room(need, removed))
            free = st.free()
            if need > free:  # keep the longest run that fits (in order: a prefix chain)
                fits = int(np.searchsorted(np.cumsum(meta.sizes[chosen]), free, side="right"))
                chosen = chosen[:fits]
                need = int(meta.sizes[chosen].sum())
            refused = n - duplicate - collided - int(chosen.size)
            st.reserved += need
            c = st.counters
            c.refused += refused + collided
            c.duplicates += duplicate
            c.collisions += collided
            self._publish(None, removed)
        if refused + collided:
            self._metrics.refused(refused + collided)
        if not chosen.size:
            with self._lock:
                st.reserved -= need
            return PutResult(0, duplicate, refused + collided)
        try:
            owns = self._copy(payload, meta, chosen)
        except Exception:
            with self._lock:
                st.reserved -= need
                st.counters.refused += int(chosen.size)
            self._metrics.refused(int(chosen.size))
            logger.exception("kvray pool: put of %d blocks failed", chosen.size)
            return PutResult(0, duplicate, refused + collided + int(chosen.size))
        with self._lock:
            st.reserved -= need
            stored = 0
            for part, own in owns:  # tail first: a chain's head enters RAM last
                kept = meta.take(part)
                # A concurrent put of the same blocks may have won the race: those stay there.
                _, pos = st.add(kept, pids[part], own, None)
                if pos.size:
                    self._publish((kept.ids[pos], kept.shards[pos], kept.nshards[pos]), None)
                stored += int(pos.size)
            late_dups = int(chosen.size) - stored
            c = st.counters
            c.stored += stored
            c.duplicates += late_dups
            c.stored_bytes += need
            c.puts += 1
            used = st.used
        self._metrics.stored(stored, need, time.perf_counter() - t0, used)
        return PutResult(stored, duplicate + late_dups, refused + collided)

    def _copy(
        self, payload: list[Any] | bytes, meta: SegmentMeta, chosen: np.ndarray
    ) -> list[tuple[np.ndarray, Any]]:
        """Map the client's segment and copy the chosen blocks into objects we own, as
        ``(blocks, object)`` parts, the tail's first. Blocks it sent by value are kept in the
        pool's own memory while they fit (:mod:`.heap`), cut into parts of at most
        ``segment_bytes`` (each a segment of its own: the unit of eviction); a segment that
        came through the object store stays whole (one ``ray.put`` each part would cost)."""
        if isinstance(payload, bytes):
            arrays, by_value = meta.rows_of(payload), True
        elif isinstance(payload[0], ObjectRef):
            arrays, by_value = ray.get(payload[0], timeout=self._get_timeout_s), False
        else:
            arrays, by_value = payload[0], True
        if not by_value:
            own = meta.select(arrays, chosen)
            ref = ray.put(own)
            del arrays, own
            return [(chosen, ref)]
        out: list[tuple[np.ndarray, Any]] = []
        for part in reversed(self._parts(meta.sizes[chosen], chosen)):
            own = meta.select(arrays, part)
            kept = self._heap.hold(own, int(meta.sizes[part].sum()))
            out.append((part, kept if kept is not None else ray.put(own)))
        return out

    def _parts(self, sizes: np.ndarray, chosen: np.ndarray) -> list[np.ndarray]:
        """``chosen`` cut into runs of at most ``segment_bytes`` (at least one block each)."""
        limit = self._segment_bytes
        if limit <= 0 or int(sizes.sum()) <= limit:
            return [chosen]
        out, start, size = [], 0, 0
        for i, n in enumerate(sizes.tolist()):
            if i > start and size + n > limit:
                out.append(chosen[start:i])
                start, size = i, 0
            size += n
        out.append(chosen[start:])
        return out

    # ------------------------------------------------------------------ reads
    def lease(
        self,
        keys: list[bytes],
        ids: np.ndarray,
        shards: np.ndarray | int,
        timeout: float | None = None,
        remote: bool = False,
        inline: int = 0,
    ) -> LeaseReply:
        """Locate blocks (by id, then full key) and protect their segments from eviction
        until released; a key whose id matches another key's block reads as not found.
        Blocks held only on disk are promoted back to RAM, or served from their file when RAM
        is all leased (:mod:`.promote`), outside the lock, within ``timeout`` (the reader's
        time left; default ``get_timeout_s``). ``remote``: a reader on another node gets a
        fresh object of just its blocks, not a segment it reads little of (:mod:`.slices`).
        ``inline``: when the blocks served from RAM come to at most this many bytes, they come
        back in the reply itself, unleased (:func:`.slices.inline`)."""
        left = self._get_timeout_s if timeout is None else max(0.0, float(timeout))
        deadline = time.monotonic() + 0.8 * left  # the reply must reach the reader in time
        pids = shard_ids(np.asarray(ids, dtype=np.uint64), shards)
        st = self._state
        reads = self._tiering.reads if self._tiering is not None else None
        pins: list[int] = []
        before: np.ndarray | None = None
        failed: dict[int, str] = {}
        if reads is not None:
            with self._lock:
                pins, before = reads.pin(pids)
            if pins:
                failed = reads.promote(pins, deadline)
        direct: list[tuple[int, int, int]] = []
        whole: dict[int, int] = {}  # bytes of the segments leased, for a remote reader
        read: dict[int, int] = {}  # bytes served per segment, in the order of the prefix
        held, refs = 0, []  # what reads served from files hold until the lease goes
        try:
            with self._lock:
                self._expire_leases()
                reply = LeaseReply.empty(self._leases.next_id(), len(keys))
                for i, seg_id, pos in st.locate(keys, pids):
                    seg = st.segments[seg_id]
                    if seg.ref is None:  # on disk only: RAM had no unleased room for it
                        direct.append((i, seg_id, pos))
                        continue
                    reply.point(i, seg_id, pos, seg.meta.sizes[pos], seg.meta.checksums[pos])
                    seg.hits[pos] += 1
                    if seg.in_ram:
                        read[seg_id] = read.get(seg_id, 0) + int(seg.meta.sizes[pos])
                    if seg_id not in reply.segments:
                        seg.leases += 1
                        reply.segments[seg_id] = seg.ref
                        whole[seg_id] = seg.meta.nbytes
                st.touch(list(read), list(read.values()))
                if direct and reads is not None:
                    reads.pin_more(direct, pins)
            if direct and reads is not None:
                held, refs = reads.serve(reply, direct, deadline)
            cut, inlined = slices.inline(reply, inline, deadline) if inline else ([], 0)
            copied = 0
            if remote and whole and not inlined:
                sliced, copied = slices.cut(reply, whole, deadline)
                cut += sliced  # (what inline found lost is not leased either)
            heap.objects_for(reply, self._keep_object, deadline)
        finally:
            with self._lock:
                st.unlease(pins)
        with self._lock:
            if before is not None:
                reads.explain(reply, before, failed)  # type: ignore[union-attr]
            found = reply.num_found
            missing = len(keys) - found
            st.counters.hits += found
            st.counters.misses += missing
            st.unlease(cut)  # served from objects of their own: no lease needed
            st.counters.sliced_bytes += copied
            st.counters.inlined_bytes += inlined
            st.counters.served_bytes += inlined  # no lease comes back to count them
            mine = [s for s in reply.segments if s > 0 and s not in cut]
            if mine or held or refs:
                self._leases.add(reply.lease_id, mine, held, refs)
                st.counters.leases += 1
        self._metrics.looked_up(found, missing)
        if inlined:
            self._metrics.served(inlined)
        return reply

    def _keep_object(self, seg_id: int, held: heap.HeapSegment, ref: ObjectRef) -> None:
        """A read needed an object of heap segment ``seg_id``: later readers get it too."""
        with self._lock:
            seg = self._state.segments.get(seg_id)
            if seg is not None and seg.ref is held:
                seg.ref = ref

    def lease_wire(self, request: bytes) -> bytes | LeaseReply:
        """:meth:`lease` with its arguments in one value (:func:`~kvray.meta.wire.lease_request`);
        a reply served wholly by value comes back as bytes (:func:`~kvray.meta.wire.reply_to_wire`),
        one that names objects as it is."""
        keys, ids, shard, timeout, remote, inline = wire.parse_lease_request(request)
        reply = self.lease(keys, ids, shard, timeout, remote=remote, inline=inline)
        return wire.reply_to_wire(reply) or reply

    def release_many(self, leases: list[tuple[int, int]]) -> None:
        """Release a batch of ``(lease_id, served_bytes)`` (one call per reader and cycle)."""
        served = 0
        with self._lock:
            for lease_id, nbytes in leases:
                served += nbytes
                self._unlease(self._leases.pop(lease_id))
            self._state.counters.served_bytes += served
        if served:
            self._metrics.served(served)

    def release(self, lease_id: int, served_bytes: int = 0) -> None:
        self.release_many([(lease_id, served_bytes)])

    def _expire_leases(self) -> None:
        for held in self._leases.pop_expired():
            self._unlease(held)

    def _unlease(self, held: Held) -> None:
        self._state.unlease(held.seg_ids)
        if held.direct_bytes and self._tiering is not None:
            self._tiering.reads.give_back(held.direct_bytes)

    def report_lost(
        self, keys: list[bytes], ids: np.ndarray, shards: np.ndarray | int, reason: str = "corrupt"
    ) -> int:
        """A reader found these blocks unusable (checksum or size mismatch): never serve them
        again. The segment's bytes stay counted until its last block goes."""
        pids = shard_ids(np.asarray(ids, dtype=np.uint64), shards)
        removed = Removed()
        dropped = 0
        st = self._state
        with self._lock:
            for _, seg_id, pos in st.locate(keys, pids):
                seg = st.segments[seg_id]
                dropped += st.forget(seg_id, seg, np.array([pos]), removed)
                st.drop_if_unused(seg_id, seg)
            st.counters.lost += dropped
            self._publish(None, removed)
        if dropped:
            logger.warning("kvray pool: dropped %d lost block(s): %s", dropped, reason)
            self._metrics.lost(dropped)
        return dropped

    # ------------------------------------------------------------------ index and health
    def _publish(
        self,
        added: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
        removed: Removed | None,
    ) -> None:
        """Queue changes for the index shards (under the lock, so in the pool's order)."""
        if removed is not None and removed.ids:
            self._pub.removed(np.concatenate(removed.ids), np.concatenate(removed.shards))
        if added is not None:
            self._pub.added(*added)
        if self._state.shares_ghosts:
            evicted, heads = self._state.take_ghost_changes()
            if evicted.size or heads.size:
                self._pub.ghosts(evicted, heads)

    def _ghost_notice(self, notice: GhostNotice) -> None:
        """An index shard's news of the cluster's ghosts (on the publisher's thread)."""
        with self._lock:
            self._state.ghost_notice(notice)

    def inventory(self, shard: int = 0, num_shards: int = 1) -> Inventory:
        """Every block shard this pool holds (RAM and disk) whose id falls in index shard
        ``shard``."""
        with self._lock:
            versions = self._pub.versions()  # nothing buffered is missed by the resync
            ids, sh, nsh = self._state.held()
            version = versions[shard] if shard < len(versions) else 0
        if ids.size:
            mine = index_shard_of(ids, num_shards) == shard
            ids, sh, nsh = ids[mine], sh[mine], nsh[mine]
        return Inventory(self._slot, self._incarnation, version, ids, sh, nsh)

    def ping(self) -> tuple[int, str, tuple[int, ...]]:
        """(slot, incarnation, update version per index shard), after sending anything
        buffered: a barrier that pinged waits for every change made before the ping."""
        with self._lock:
            return self._slot, self._incarnation, self._pub.versions()

    def close_disk(self, purge: bool = False, timeout: float = 10.0) -> int:
        """Before the pool is killed (``kvray.stop``): stop spilling, let queued writes finish
        for up to ``timeout`` s, release the disk slot; with ``purge``, first delete every
        file of the namespace on this host. Returns the files deleted (0 without a tier)."""
        number = not isinstance(timeout, bool) and isinstance(timeout, int | float)
        if not number or not 0 <= timeout <= 3600:  # NaN, infinity: every wait has a bound
            raise InvalidArgumentError(f"close_disk: timeout must be in [0, 3600] s: {timeout!r}")
        if self._tiering is None:
            return 0
        return self._tiering.close(bool(purge), float(timeout))

    def stats(self) -> dict[str, Any]:
        disk = self._tiering.figures() if self._tiering is not None else {}
        with self._lock:
            self._expire_leases()
            return {
                "node_id": self._node_id,
                "slot": self._slot,
                **self._state.figures(),
                "capacity": self._capacity,
                "heap_bytes": self._heap.used,
                "active_leases": len(self._leases),
                "expired_leases": self._leases.expired,
                "thread_deaths": self.thread_deaths,
                **disk,
            }


#: The actor; created with ``run=True`` so that it starts its threads in every incarnation.
BlockPoolActor = ray.remote(BlockPool)
