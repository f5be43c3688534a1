"""Reads of blocks held only on disk (issue 18): promote them to RAM, or serve them from the file.

A lease that asks for blocks whose segment is on disk only first *pins* that segment (a lease
of its own, so neither RAM nor a concurrent reader drops it), then:

- **Promote.** Room is made in RAM by evicting unleased segments, least recently used first,
  as for a put; the file is memory-mapped, every block checked against its xxh3, and the bytes
  ``ray.put`` as a pool-owned object that the lease serves like any RAM segment. A concurrent
  reader of the same segment waits for that promotion (within its read's timeout).
- **Serve from the file.** When every segment in RAM is leased (RAM smaller than what readers
  hold at once), the read does not fail: the blocks asked for are mapped, verified and put in
  an object of their own, outside RAM's count, held by the reader's lease. Their bytes count
  against a bound (the RAM capacity; one read always passes when none is outstanding): beyond
  it the read waits, within its timeout, for leases to come back.

A read fails only for a reason it names (``LeaseReply.reasons``), each counted in
``promote_failed_<cause>``: ``no_room`` (the wait above ran out), ``corrupt`` (a checksum
mismatch or an invalid file: those blocks are dropped, published as removed, never served) or
``io`` (the file could not be read). Blocks served from a file count in ``read_from_disk``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from kvray.actors.poolstate import Removed
from kvray.disk import DiskSegment
from kvray.errors import BlockLostError
from kvray.meta.messages import LeaseReply

if TYPE_CHECKING:
    from kvray.actors.tiering import Tiering

logger = logging.getLogger(__name__)

__all__ = ["CHECKSUM", "DiskReads", "failure_cause"]

#: The reason a block whose bytes on disk fail their checksum is not served.
CHECKSUM = "checksum mismatch on disk"
#: Failed promotions remembered for the readers that waited on them.
MAX_FAILURES = 1024

#: ``(key index in the request, segment id, position)`` of a block to read from its file.
Wanted = list[tuple[int, int, int]]


def failure_cause(reason: str) -> str:
    """``corrupt`` or ``io``: the counter a failed read of a file goes to."""
    return "corrupt" if reason.startswith(("corrupt", "checksum")) else "io"


class DiskReads:
    """Promotions and reads from files for one pool (its lock guards everything here)."""

    def __init__(self, tiering: Tiering) -> None:
        self._t = tiering
        self._state = tiering.state
        self._lock = tiering.lock
        self._room = threading.Condition(self._lock)  # reads from files given back
        self._promoting: dict[int, threading.Event] = {}
        self._failed: OrderedDict[int, str] = OrderedDict()  # why promotions lost blocks
        self.limit = self._state.capacity  # bytes of objects served from files, outstanding
        self.outstanding = 0
        self.expire: Callable[[], None] = lambda: None  # the pool's lease expiry (lock held)

    # ------------------------------------------------------------------ pins
    def pin(self, pids: np.ndarray) -> tuple[list[int], np.ndarray]:
        """Under the lock: pin the disk-only segments holding these ids; also the segment id
        of each (0: not held) to explain a miss after :meth:`promote`."""
        st = self._state
        slots = st.table.find(pids)
        held = slots >= 0
        segs = np.zeros(len(pids), dtype=np.int64)
        segs[held] = st.table.cols["seg"][slots[held]]
        pins = []
        for seg_id in np.unique(segs[held]).tolist():
            seg = st.segments[seg_id]
            if seg.disk is not None and self._t.tier is not None:
                self._t.tier.touch(seg.disk)
                if seg.ref is None:
                    seg.leases += 1
                    pins.append(seg_id)
        return pins, segs

    def pin_more(self, wanted: Wanted, pins: list[int]) -> None:
        """Under the lock: also pin segments that went to disk since :meth:`pin`."""
        for seg_id in {s for _, s, _ in wanted} - set(pins):
            self._state.segments[seg_id].leases += 1
            pins.append(seg_id)

    # ------------------------------------------------------------------ promotion
    def promote(self, seg_ids: list[int], deadline: float) -> dict[int, str]:
        """Bring pinned disk-only segments back to RAM where there is room (without the
        pool's lock); returns why each segment that lost blocks lost them."""
        failed: dict[int, str] = {}
        for seg_id in seg_ids:
            try:
                why = self._promote(seg_id, deadline)
            except Exception:  # a bug: the blocks stay on disk, served from the file
                logger.exception("kvray pool: promoting segment %d failed", seg_id)
                why = ""
            if why:
                failed[seg_id] = why
        return failed

    def _promote(self, seg_id: int, deadline: float) -> str:
        with self._lock:
            claim = self._claim(seg_id)
        if isinstance(claim, threading.Event):  # another reader is promoting it
            claim.wait(max(0.0, deadline - time.monotonic()))
            with self._lock:
                return self._failed.get(seg_id, "")
        if claim is None:
            return ""
        disk, nbytes, done = claim
        ref: Any = None
        bad: list[int] = []
        error = ""
        try:
            payload = self._t.tier.read(disk)  # type: ignore[union-attr]
            bad = self._t.tier.verify(disk, payload)  # type: ignore[union-attr]
            ref = ray.put(payload)
            del payload
        except BlockLostError as e:
            error = e.reason
        except Exception as e:
            logger.exception("kvray pool: reading %s failed", disk.path)
            error = f"disk read failed: {type(e).__name__}: {e}"
        finally:
            with self._lock:
                self._state.reserved -= nbytes
                del self._promoting[seg_id]
                self._adopt(seg_id, disk, ref, bad, error)
            done.set()
        return error or (CHECKSUM if bad else "")

    def _claim(
        self, seg_id: int
    ) -> tuple[DiskSegment, int, threading.Event] | threading.Event | None:
        """Under the lock: room in RAM for a segment to promote, and the right to promote it
        (or the promotion under way to wait for; None: nothing to do, or no unleased room:
        the read is served from the file)."""
        st = self._state
        seg = st.segments.get(seg_id)
        if seg is None or seg.ref is not None or seg.disk is None:
            return None
        waiting = self._promoting.get(seg_id)
        if waiting is not None:
            return waiting
        nbytes = seg.meta.nbytes
        if nbytes > st.capacity:
            return None
        removed = Removed()
        self._t.metrics.evicted(st.make_room(nbytes, removed))
        self._t.publish(None, removed)
        if nbytes > st.free():
            return None
        st.reserved += nbytes
        done = self._promoting[seg_id] = threading.Event()
        return seg.disk, nbytes, done

    def _adopt(self, seg_id: int, disk: DiskSegment, ref: Any, bad: list[int], error: str) -> None:
        """Under the lock: a promotion's outcome (the segment may have changed meanwhile)."""
        st = self._state
        seg = st.segments.get(seg_id)
        if seg is None or seg.disk is not disk:
            return  # its file was evicted or purged meanwhile: its blocks are gone already
        if error or bad:
            self._drop(seg_id, None if error else bad, error or CHECKSUM)
            self._t.unlink_disk(seg, remove="evicted" not in error)
            self._failed[seg_id] = error or CHECKSUM  # for readers that waited on it
            while len(self._failed) > MAX_FAILURES:
                self._failed.popitem(last=False)
        if ref is not None and seg.live_count:
            st.enter_ram(seg_id, seg, ref)
            st.counters.promoted += seg.live_count
            st.counters.promoted_bytes += seg.meta.nbytes
        else:
            st.drop_if_unused(seg_id, seg)

    def _drop(self, seg_id: int, positions: list[int] | None, why: str) -> None:
        """Under the lock: never serve these blocks of a file again (None: all of them);
        published as removed, counted in ``disk_lost`` and ``promote_failed_<cause>``."""
        st = self._state
        seg = st.segments[seg_id]
        removed = Removed()
        pos = np.arange(len(seg.meta)) if positions is None else np.asarray(positions, np.int64)
        lost = st.forget(seg_id, seg, pos, removed)
        c = st.counters
        c.disk_lost += lost
        if failure_cause(why) == "corrupt":
            c.promote_failed_corrupt += lost
        else:
            c.promote_failed_io += lost
        path = seg.disk.path if seg.disk is not None else "?"
        logger.warning("kvray pool: dropped %d block(s) of %s: %s", lost, path, why)
        self._t.publish(None, removed)

    # ------------------------------------------------------------------ reads from files
    def serve(self, reply: LeaseReply, wanted: Wanted, deadline: float) -> tuple[int, list[Any]]:
        """Serve blocks of pinned disk-only segments straight from their files into ``reply``
        (call it without the lock). Returns the bytes and objects the lease must hold."""
        st = self._state
        need = 0
        by_seg: dict[int, list[tuple[int, int]]] = {}
        with self._lock:
            for i, seg_id, pos in wanted:
                by_seg.setdefault(seg_id, []).append((i, pos))
                need += int(st.segments[seg_id].meta.sizes[pos])
            while self.outstanding and self.outstanding + need > self.limit:
                self.expire()  # a dead reader's leases, past their deadline
                left = deadline - time.monotonic()
                if left <= 0:
                    why = (
                        f"no room in RAM: every segment leased and {self.outstanding} bytes "
                        "already served from disk to other readers"
                    )
                    for i, _, _ in wanted:
                        reply.reasons[i] = why
                    st.counters.promote_failed_no_room += len(wanted)
                    return 0, []
                self._room.wait(min(left, 0.5))
            self.outstanding += need
            jobs = [(seg_id, st.segments[seg_id].disk, items) for seg_id, items in by_seg.items()]
        held, refs = 0, []
        try:
            for k, (seg_id, disk, items) in enumerate(jobs):
                try:
                    nbytes, ref = self._serve_one(reply, -(k + 1), seg_id, disk, items)
                except Exception:  # a bug: these keys are not served, and say so
                    logger.exception("kvray pool: serving segment %d from disk failed", seg_id)
                    reply.segments.pop(-(k + 1), None)
                    for i, _ in items:
                        reply.seg_ids[i] = 0
                        reply.reasons[i] = "disk read failed: internal error (see the pool log)"
                    continue
                held += nbytes
                if ref is not None:
                    refs.append(ref)
        finally:
            with self._lock:
                self.give_back(need - held)
        return held, refs

    def _serve_one(
        self,
        reply: LeaseReply,
        fake_id: int,
        seg_id: int,
        disk: DiskSegment | None,
        items: list[tuple[int, int]],
    ) -> tuple[int, Any]:
        """Map, verify and put the blocks ``items`` (key index, position) of one file, then
        fill ``reply`` under the lock. Returns the bytes of the object made and the object."""
        bad: list[int] = []
        good: list[tuple[int, int]] = []
        error = ""
        ref: Any = None
        try:
            if disk is None:
                raise BlockLostError([], "evicted from the disk tier")
            payload = self._t.tier.read(disk)  # type: ignore[union-attr]
            positions = sorted({p for _, p in items})
            bad = self._t.tier.verify(disk, payload, positions)  # type: ignore[union-attr]
            good = [(i, p) for i, p in items if p not in bad]
            if good:
                ref = ray.put([payload[p] for _, p in good])
            del payload
        except BlockLostError as e:
            error = e.reason
        except Exception as e:
            logger.exception("kvray pool: serving from %s failed", getattr(disk, "path", "?"))
            error = f"disk read failed: {type(e).__name__}: {e}"
        st = self._state
        with self._lock:
            seg = st.segments.get(seg_id)
            if seg is None or disk is None or seg.disk is not disk:
                for i, _ in items:  # its file was evicted or purged meanwhile
                    reply.reasons[i] = "evicted from the disk tier"
                return 0, None
            if error:  # the file is gone or unreadable: none of its blocks can be served
                self._drop(seg_id, None, error)
                self._t.unlink_disk(seg, remove="evicted" not in error)
                st.drop_if_unused(seg_id, seg)
            elif bad:  # the rest of the file is good: it keeps serving them
                self._drop(seg_id, bad, CHECKSUM)
            for i, p in items:
                if error or p in bad:
                    reply.reasons[i] = error or CHECKSUM
            served = 0
            for j, (i, p) in enumerate(good):
                if not seg.live[p]:
                    reply.reasons[i] = "dropped while read"
                    continue
                reply.point(i, fake_id, j, seg.meta.sizes[p], seg.meta.checksums[p])
                seg.hits[p] += 1
                served += 1
            if not served:
                return 0, None
            reply.segments[fake_id] = ref
            nbytes = sum(int(seg.meta.sizes[p]) for _, p in good)
            st.counters.read_from_disk += served
            st.counters.read_from_disk_bytes += nbytes
        return nbytes, ref

    def give_back(self, nbytes: int) -> None:
        """Under the lock: bytes served from files that their readers let go."""
        if nbytes:
            self.outstanding -= nbytes
            self._room.notify_all()

    # ------------------------------------------------------------------ misses
    @staticmethod
    def explain(reply: LeaseReply, before: np.ndarray, failed: dict[int, str]) -> None:
        """Name why a key held before its promotion was not served (its file failed)."""
        if not failed:
            return
        for i in np.flatnonzero(reply.seg_ids == 0).tolist():
            why = failed.get(int(before[i]))
            if why and i not in reply.reasons:
                reply.reasons[i] = why
