"""A pool's disk side (issue 12): spill what RAM evicts, promote what is read, come back warm.

- **Spill.** A segment RAM evicts (:meth:`PoolState.make_room`) keeps its blocks visible: those
  read at least ``disk_admit_min_hits`` times are queued for the disk (``spill`` positions), the
  rest are dropped (published as removed). The eviction only appends to a queue; a thread of
  ours maps the pool's object (``ray.get``, zero-copy) and hands it to the tier, whose writer
  thread writes it. Until ``on_spilled`` the blocks are served from that object, which stays in
  the object store outside the RAM count: at most ``max_pending_bytes`` of it (beyond, and when
  the tier refuses or a write fails, the blocks are dropped as RAM alone would, counted in
  ``disk_skipped``). Then the segment is on disk only and its object is let go.
- **Read back.** A lease of a block held only on disk promotes its segment to RAM, or, when
  RAM is all leased, serves the block straight from the verified file (:mod:`.promote`).
- **Disk eviction.** A file the tier evicts (LRU within ``disk_capacity``) takes its blocks
  with it (published as removed), unless they are in RAM.
- **Warm restart.** At start the tier scans its slot; surviving files are registered as
  disk-only segments (their ids recomputed from the keys and checked) and published, and the
  pool's inventory lists them, so index shards rebuild with them.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

import numpy as np

from kvray.actors.heap import value
from kvray.actors.poolstate import PoolState, Removed, Segment
from kvray.actors.promote import DiskReads
from kvray.disk import DiskSegment, DiskSettings, DiskTier, admit, fingerprint
from kvray.meta.ids import key_ids, shard_ids
from kvray.metrics import PoolMetrics
from kvray.threads import SupervisedThread

logger = logging.getLogger(__name__)

__all__ = ["Tiering"]

#: ``publish(added, removed)``: the pool's queue of changes for the index shards.
Publish = Callable[[tuple[np.ndarray, np.ndarray, np.ndarray] | None, Removed | None], None]


class Tiering:
    """The link between a pool's state and its :class:`DiskTier` (threads in :meth:`start`)."""

    def __init__(
        self,
        settings: DiskSettings,
        namespace: str,
        node_id: str,
        state: PoolState,
        lock: threading.Lock,
        publish: Publish,
        get_timeout_s: float,
    ) -> None:
        self.settings = settings
        self._ns = namespace
        self._node_id = node_id
        self._state = state
        self._lock = lock
        self._publish = publish
        self._timeout = get_timeout_s
        self.tier: DiskTier | None = None
        self._by_file: dict[int, int] = {}  # file id -> segment id
        self._queue: deque[int] = deque()  # segments to hand to the tier
        self._wake = threading.Condition()
        self._spilling = 0  # bytes of segments on their way to disk
        self._closed = False
        self._spiller = SupervisedThread(
            self._run, "kvray-spill", f"the disk tier of {namespace!r}", on_death=self._spill_died
        )
        self.metrics = PoolMetrics.disabled()  # the pool's, once it has them
        self.state, self.lock, self.publish = state, lock, publish  # for :attr:`reads`
        self.reads = DiskReads(self)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> int:
        """Take the slot, scan it, register the files' blocks, start the threads; returns the
        blocks registered."""
        s = self.settings
        tier = DiskTier(
            s.dir,
            self._ns,
            s.capacity,
            # The pool bounds what it hands over (max_pending_bytes); the tier's own bound
            # only guards against its pending count lagging ours by one group.
            max_pending_bytes=2 * s.max_pending_bytes,
            max_files=s.max_files,
            fingerprint=fingerprint(self._ns),
            owner=self._node_id,
        )
        found = tier.scan()
        tier.events.on_spilled = self._spilled
        tier.events.on_evicted = self._evicted
        tier.events.on_dropped = self._dropped
        with self._lock:
            self.tier = tier
            registered = self._register(found)
            self._state.on_evict = self._take
        tier.start()
        self._spiller.start()
        logger.info(
            "kvray pool: disk tier %s, %d bytes, %d block(s) from %d file(s) found",
            tier.dir,
            s.capacity,
            registered,
            len(found),
        )
        return registered

    def _register(self, found: list[DiskSegment]) -> int:
        st = self._state
        registered = 0
        for disk in found:
            meta = disk.meta
            if len(meta) and not np.array_equal(key_ids(meta.keys()), meta.ids):
                logger.warning("kvray pool: %s holds ids of another derivation; deleted", disk.path)
                st.counters.disk_lost += len(meta)
                self.tier.remove(disk)  # type: ignore[union-attr]
                continue
            seg_id, pos = st.add(meta, shard_ids(meta.ids, meta.shards), None, disk)
            if not seg_id:  # every block held already (by an earlier file)
                self.tier.remove(disk)  # type: ignore[union-attr]
                continue
            self._by_file[disk.id] = seg_id
            registered += int(pos.size)
            self._publish((meta.ids[pos], meta.shards[pos], meta.nshards[pos]), None)
        return registered

    def close(self, purge: bool, timeout: float) -> int:
        """Stop spilling; with ``purge`` delete every file of the namespace on this host (and
        drop the blocks held only on disk). Releases the slot. Returns the files deleted.
        Call it without the pool's lock (the writer's callbacks take it)."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        # It hands over at most one more segment (refused once the tier closes): a short wait.
        self._spiller.stop(min(timeout, 2.0))
        tier = self.tier
        if tier is None:
            return 0
        deleted = 0
        if purge:
            deleted = tier.purge(timeout)
            with self._lock:
                removed = Removed()
                for seg_id, seg in list(self._state.segments.items()):
                    if seg.disk is not None:
                        self.unlink_disk(seg, remove=False)  # deleted by the purge
                        if seg.ref is None:
                            self._state.forget_all(seg_id, seg, removed)
                            self._state.drop_if_unused(seg_id, seg)
                self._publish(None, removed)
        tier.close(timeout, drain=not purge)
        return deleted

    # ------------------------------------------------------------------ spill
    def _take(self, seg_id: int, seg: Segment, removed: Removed) -> bool:
        """RAM evicts ``seg`` (under the pool's lock): keep its blocks on disk or on their way
        there, or return False to have them dropped."""
        if seg.disk is not None:  # promoted earlier: its file is still there
            seg.ref = None
            return True
        st = self._state
        keep = seg.live.copy()
        chosen = admit(seg.hits, self.settings.admit_min_hits)
        if chosen is not None:
            keep[:] = False
            keep[chosen] = seg.live[chosen]
            st.counters.not_admitted += st.forget(seg_id, seg, np.flatnonzero(~keep), removed)
        pos = np.flatnonzero(keep)
        if not pos.size:
            return False
        nbytes = int(seg.meta.sizes[pos].sum())
        if self._closed or self._spilling + nbytes > self.settings.max_pending_bytes:
            st.counters.spill_refused += int(pos.size)
            return False
        seg.spill, seg.spill_bytes = pos, nbytes
        self._spilling += nbytes
        with self._wake:
            self._queue.append(seg_id)
            self._wake.notify()
        return True

    def _run(self) -> None:
        """Hand queued segments to the tier: map each (outside the pool's lock) and spill it."""
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait(1.0)
                if self._closed:
                    return
                seg_id = self._queue.popleft()
            with self._lock:
                seg = self._state.segments.get(seg_id)
                if seg is None or seg.spill is None or seg.ref is None:
                    continue
                ref, meta, pos = seg.ref, seg.meta, seg.spill
            answer: bool | None = None  # False: the tier refused it (and counted it)
            try:
                payload = value(ref, self._timeout)
                select = None if len(pos) == len(meta) else pos
                answer = self.tier.spill(meta, payload, select, tag=seg_id)  # type: ignore[union-attr]
                del payload
            except Exception:
                logger.exception("kvray pool: cannot hand segment %d to the disk tier", seg_id)
            if not answer:
                self._give_up([seg_id], count=answer is None)

    def _spill_died(self, _: BaseException) -> None:
        """The spill thread died for good: RAM evictions drop their blocks from now on
        (``disk_skipped``), and so do the segments it had queued."""
        with self._wake:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
        self._give_up(queued, count=True)

    @property
    def thread_deaths(self) -> int:
        """Deaths of the spill thread and the tier's writer."""
        writer = self.tier.thread_deaths if self.tier is not None else 0
        return self._spiller.deaths + writer

    def _spilled(self, disk: DiskSegment) -> None:
        """The tier wrote a segment: it is on disk now; re-keyed to the file's rows when only
        some of its blocks went."""
        with self._lock:
            st = self._state
            seg_id = disk.tag
            seg = st.segments.get(seg_id)
            if seg is None or seg.spill is None:  # dropped meanwhile: nobody reads the file
                self.tier.remove(disk)  # type: ignore[union-attr]
                return
            pos, seg.spill = seg.spill, None
            self._spilling -= seg.spill_bytes
            seg.spill_bytes = 0
            if len(pos) != len(seg.meta):
                live = seg.live[pos]
                rows = np.flatnonzero(live)
                m = disk.meta
                if rows.size:
                    pids = shard_ids(m.ids[rows], m.shards[rows])
                    st.table.upsert(pids, seg=seg_id, pos=rows.astype(np.uint32))
                seg.meta, seg.live, seg.hits = m, live.copy(), seg.hits[pos]
                seg.live_count = int(rows.size)
            seg.disk = disk
            self._by_file[disk.id] = seg_id
            if not seg.in_ram:
                seg.ref = None  # readers holding it keep their own reference
            if seg.live_count == 0:
                self.unlink_disk(seg)
                st.drop_if_unused(seg_id, seg)

    def _dropped(self, tags: list[int]) -> None:
        """The tier could not write these segments: their blocks go, as RAM alone would."""
        self._give_up(tags, count=False)

    def _give_up(self, seg_ids: list[int], count: bool) -> None:
        """Drop segments on their way to disk; ``count`` them as refused (unless the tier
        counted them itself)."""
        with self._lock:
            st = self._state
            removed = Removed()
            for seg_id in seg_ids:
                seg = st.segments.get(seg_id)
                if seg is None or seg.spill is None:
                    continue
                self._spilling -= seg.spill_bytes
                seg.spill, seg.spill_bytes = None, 0
                gone = st.forget_all(seg_id, seg, removed)
                if count:
                    st.counters.spill_refused += gone
                seg.ref = None
                st.drop_if_unused(seg_id, seg)
            self._publish(None, removed)

    def _evicted(self, disks: list[DiskSegment]) -> None:
        """The tier deleted these files to make room: blocks held only there are gone."""
        with self._lock:
            st = self._state
            removed = Removed()
            for disk in disks:
                seg_id = self._by_file.pop(disk.id, None)
                seg = st.segments.get(seg_id) if seg_id is not None else None
                if seg is None or seg.disk is not disk:
                    continue
                seg.disk = None
                if seg.ref is None:
                    st.counters.disk_gone += st.forget_all(seg_id, seg, removed)  # type: ignore[arg-type]
                    st.drop_if_unused(seg_id, seg)  # type: ignore[arg-type]
            self._publish(None, removed)

    def unlink_disk(self, seg: Segment, remove: bool = True) -> None:
        """Detach a segment from its file (under the lock), deleting the file."""
        disk, seg.disk = seg.disk, None
        if disk is not None:
            self._by_file.pop(disk.id, None)
            if remove and self.tier is not None:
                self.tier.remove(disk)

    # ------------------------------------------------------------------ figures
    def figures(self) -> dict[str, int]:
        """The tier's figures, with what the pool refused before reaching it in
        ``disk_skipped`` (called without the pool's lock)."""
        out = self.tier.stats() if self.tier is not None else {}
        c = self._state.counters
        out["disk_skipped"] = out.get("disk_skipped", 0) + c.spill_refused
        out.update(
            promoted=c.promoted,
            promoted_bytes=c.promoted_bytes,
            read_from_disk=c.read_from_disk,
            read_from_disk_bytes=c.read_from_disk_bytes,
            read_from_disk_outstanding_bytes=self.reads.outstanding,
            promote_failed=(
                c.promote_failed_no_room + c.promote_failed_corrupt + c.promote_failed_io
            ),
            promote_failed_no_room=c.promote_failed_no_room,
            promote_failed_corrupt=c.promote_failed_corrupt,
            promote_failed_io=c.promote_failed_io,
            disk_not_admitted=c.not_admitted,
            disk_lost=c.disk_lost,
            spilling_bytes=self._spilling,
            disk_max_pending_bytes=self.settings.max_pending_bytes,
        )
        return out
