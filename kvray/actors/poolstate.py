"""The blocks of a pool: its segments, their RAM eviction order and byte count, the id table.

Not thread-safe: the pool (:mod:`.pool`) and its disk side (:mod:`.tiering`) call it holding the
pool's lock. Metadata is numpy throughout (about 110 bytes a block): a table from shard id
(:func:`kvray.meta.ids.shard_ids`) to (segment, position), and per segment the full keys in one
blob plus arrays of ids, shard numbers, sizes, checksums and read counts. Which segment RAM
evicts first is the ``eviction_policy``'s call (:mod:`kvray.meta.eviction`: ``lru``,
``probation``, ``adaptive`` or ``aged``); its bookkeeping is per segment, counted in ``meta_bytes``.

A segment is in one of four states, and its blocks are in the table (visible to lookups) in
every one of them:

- in RAM: ``in_ram``, its object ``ref`` counted in ``used`` and ranked by ``policy``;
- on its way to disk: ``spill`` set, ``ref`` still served, counted by the disk side (at most
  its ``max_pending_bytes``), not in ``used``;
- on disk only: ``ref`` None, ``disk`` set;
- in RAM with a copy on disk (promoted): ``in_ram`` and ``disk``; RAM evicting it only lets go
  of its object.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from ray import ObjectRef

from kvray.actors.heap import HeapSegment
from kvray.disk import DiskSegment
from kvray.meta.eviction import ProbationPolicy, make_policy
from kvray.meta.ids import shard_ids
from kvray.meta.idtable import IdTable
from kvray.meta.messages import GhostNotice
from kvray.meta.segment import SegmentMeta

__all__ = ["STATS_COUNTERS", "Counters", "PoolState", "Removed", "Segment"]


@dataclass(eq=False)
class Segment:
    # The pool's object of the segment, or its blocks in the pool's own memory (a small
    # segment, :mod:`.heap`); None: on disk only.
    ref: ObjectRef | HeapSegment | None
    meta: SegmentMeta
    live: np.ndarray  # bool per block: still held (in the table)
    live_count: int
    hits: np.ndarray  # uint32 per block: times read (disk admission)
    leases: int = 0
    in_ram: bool = False
    disk: DiskSegment | None = None
    spill: np.ndarray | None = None  # positions on their way to disk
    spill_bytes: int = 0


#: The counters a pool's ``stats()`` reports as they are (the disk tier reports the others).
STATS_COUNTERS = (
    "hits",
    "misses",
    "evictions",
    "refused",
    "lost",
    "stored",
    "duplicates",
    "collisions",
    "stored_bytes",
    "served_bytes",
    "sliced_bytes",
    "inlined_bytes",
    "puts",
)


@dataclass
class Counters:
    """A pool's counters (blocks, unless named bytes)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0  # left RAM (to disk or gone)
    refused: int = 0
    lost: int = 0
    stored: int = 0
    duplicates: int = 0
    collisions: int = 0
    stored_bytes: int = 0
    served_bytes: int = 0
    sliced_bytes: int = 0  # copied into objects of their own for readers on other nodes
    inlined_bytes: int = 0  # small reads answered by value, in the lease's reply
    puts: int = 0
    leases: int = 0
    promoted: int = 0  # read back from disk into RAM
    promoted_bytes: int = 0
    read_from_disk: int = 0  # served straight from a file: RAM had no unleased room
    read_from_disk_bytes: int = 0
    # Asked for on disk and not served (``promote_failed`` in stats() is their sum): no room
    # (RAM all leased and the bound on reads served from disk held for the read's timeout),
    # corrupt (checksum mismatch, invalid file) or I/O (the file could not be read).
    promote_failed_no_room: int = 0
    promote_failed_corrupt: int = 0
    promote_failed_io: int = 0
    not_admitted: int = 0  # left RAM and not spilled: read fewer than disk_admit_min_hits
    spill_refused: int = 0  # left RAM and not spilled: the way to disk was full
    disk_lost: int = 0  # dropped from disk: corrupt, unreadable or foreign
    disk_gone: int = 0  # dropped with a file the tier evicted


@dataclass
class Removed:
    """Blocks dropped under the lock, to publish as removed."""

    ids: list[np.ndarray] = field(default_factory=list)
    shards: list[np.ndarray] = field(default_factory=list)


#: ``(seg_id, segment, removed) -> kept``: the disk side's say on a segment RAM evicts.
EvictHook = Callable[[int, Segment, Removed], bool]


class PoolState:
    """Segments, RAM eviction order and the id table of one pool (the caller holds the pool's
    lock)."""

    def __init__(self, capacity: int, eviction_policy: str = "lru") -> None:
        self.capacity = capacity
        self.table = IdTable({"seg": np.uint32, "pos": np.uint32})
        self.segments: dict[int, Segment] = {}
        self.policy = make_policy(eviction_policy, capacity)  # ranks the segments in RAM
        #: The policy remembers ghosts: the cluster shares them (:mod:`kvray.meta.ghosts`).
        self.shares_ghosts = isinstance(self.policy, ProbationPolicy)
        self.policy.keep_evicted = self.shares_ghosts
        self._heads: list[int] = []  # keys of the segments entered since the last take
        self.used = 0  # bytes of the segments in RAM
        self.reserved = 0  # bytes promised to copies in flight (puts, promotions)
        self.counters = Counters()
        self.on_evict: EvictHook | None = None
        self._ids = itertools.count(1)

    def free(self) -> int:
        return self.capacity - self.used - self.reserved

    # ------------------------------------------------------------------ adding
    def new_blocks(self, meta: SegmentMeta, pids: np.ndarray) -> tuple[np.ndarray, int, int]:
        """Indices of the blocks to keep (in order), duplicates, id collisions."""
        _, first = np.unique(pids, return_index=True)
        first.sort()
        duplicate = len(meta) - int(first.size)
        slots = self.table.find(pids[first])
        held = slots >= 0
        collided = 0
        if held.any():
            cols = self.table.cols
            for i, slot in zip(first[held].tolist(), slots[held].tolist(), strict=True):
                seg = self.segments[int(cols["seg"][slot])]
                if seg.meta.key(int(cols["pos"][slot])) == meta.key(i):
                    duplicate += 1
                else:
                    collided += 1  # another key with the same id: keep the first
        return first[~held], duplicate, collided

    def add(
        self,
        meta: SegmentMeta,
        pids: np.ndarray,
        ref: ObjectRef | HeapSegment | None,
        disk: DiskSegment | None,
    ) -> tuple[int, np.ndarray]:
        """Register a segment (in RAM when ``ref``, else on disk only); returns its id and the
        positions stored (0 and none when every block is held already)."""
        live = self.table.find(pids) < 0
        pos = np.flatnonzero(live)
        if not pos.size:
            return 0, pos
        seg_id = next(self._ids)
        self.table.upsert(pids[pos], seg=seg_id, pos=pos.astype(np.uint32))
        hits = np.zeros(len(meta), dtype=np.uint32)
        seg = Segment(ref, meta, live, int(pos.size), hits, disk=disk)
        self.segments[seg_id] = seg
        if ref is not None:
            self.enter_ram(seg_id, seg, ref)
        return seg_id, pos

    def enter_ram(self, seg_id: int, seg: Segment, ref: ObjectRef | HeapSegment) -> None:
        seg.ref, seg.in_ram = ref, True
        key = int(seg.meta.ids[0]) if len(seg.meta) else 0
        self.policy.insert(seg_id, seg.meta.nbytes, seg.live_count, key)
        self.used += seg.meta.nbytes
        if self.shares_ghosts and key:
            self._heads.append(key)

    def take_ghost_changes(self) -> tuple[np.ndarray, np.ndarray]:
        """Keys of the segments evicted (leaving a ghost) and entered since the last call."""
        evicted = np.array(self.policy.take_ghosts(), dtype=np.uint64)
        heads, self._heads = np.array(self._heads, dtype=np.uint64), []
        return evicted, heads

    def ghost_notice(self, notice: GhostNotice) -> None:
        """The cluster's news (:mod:`kvray.meta.news`): segments to promote (ghosts
        elsewhere, or the copy readers see of a block put twice), ghosts of ours that came
        back in other pools, copies of ours no reader sees (evicted first) and copies of
        ours put again elsewhere (a read)."""
        for key in notice.promote.tolist():
            self.policy.promote(int(key))
        for key in notice.returned.tolist():
            self.policy.ghost_returned(int(key))
        for seg_id in self._segments_of(notice.demote):
            self.policy.demote(seg_id)
        for seg_id in self._segments_of(notice.reused):
            self.policy.touch([seg_id], [0])

    def _segments_of(self, ids: np.ndarray) -> list[int]:
        """The segments in RAM holding (shard 0 of) these block ids, once each."""
        if not ids.size:
            return []
        slots = self.table.find(shard_ids(ids.astype(np.uint64), 0))
        segs = self.table.cols["seg"][slots[slots >= 0]].tolist()
        out = dict.fromkeys(int(s) for s in segs)
        return [s for s in out if (seg := self.segments.get(s)) is not None and seg.in_ram]

    def touch(self, seg_ids: list[int], hit_bytes: list[int]) -> None:
        """A read served ``hit_bytes`` from these segments, in the order of its prefix."""
        self.policy.touch(seg_ids, hit_bytes)

    # ------------------------------------------------------------------ finding
    def locate(self, keys: list[bytes], pids: np.ndarray) -> list[tuple[int, int, int]]:
        """``(i, seg_id, pos)`` of every key held (full keys compared; a collision is
        counted and reads as not found)."""
        slots = self.table.find(pids)
        cols = self.table.cols
        out = []
        for i in np.flatnonzero(slots >= 0).tolist():
            seg_id = int(cols["seg"][slots[i]])
            pos = int(cols["pos"][slots[i]])
            if self.segments[seg_id].meta.key(pos) != keys[i]:
                self.counters.collisions += 1
                continue
            out.append((i, seg_id, pos))
        return out

    def segments_of(self, pids: np.ndarray) -> list[int]:
        """Ids of the segments holding these block ids (no key check)."""
        slots = self.table.find(pids)
        return np.unique(self.table.cols["seg"][slots[slots >= 0]]).tolist()

    # ------------------------------------------------------------------ dropping
    def forget(self, seg_id: int, seg: Segment, pos: np.ndarray, removed: Removed) -> int:
        """Drop blocks ``pos`` of a segment from the table; queue their removal."""
        pos = pos[seg.live[pos]]
        if not pos.size:
            return 0
        meta = seg.meta
        pids = shard_ids(meta.ids[pos], meta.shards[pos])
        slots = self.table.find(pids)
        mine = (slots >= 0) & (self.table.cols["seg"][slots] == seg_id)
        self.table.delete_slots(slots[mine])
        seg.live[pos] = False
        seg.live_count -= int(pos.size)
        removed.ids.append(meta.ids[pos[mine]])
        removed.shards.append(meta.shards[pos[mine]])
        return int(mine.sum())

    def forget_all(self, seg_id: int, seg: Segment, removed: Removed) -> int:
        return self.forget(seg_id, seg, np.flatnonzero(seg.live), removed)

    def leave_ram(self, seg_id: int, seg: Segment, evicted: bool = False) -> None:
        if seg.in_ram:
            self.policy.remove(seg_id, evicted)
            self.used -= seg.meta.nbytes
            seg.in_ram = False

    def drop_if_unused(self, seg_id: int, seg: Segment) -> bool:
        """Forget a segment with no live block and no lease (its object goes with it)."""
        if seg.live_count or seg.leases or self.segments.get(seg_id) is not seg:
            return False
        self.leave_ram(seg_id, seg)
        del self.segments[seg_id]
        seg.ref = None
        return True

    def make_room(self, need: int, removed: Removed) -> int:
        """Evict unleased segments from RAM in the policy's order (``lru``: least recently
        used first) until ``need`` bytes fit; returns the blocks that left RAM. ``on_evict``
        may keep a segment's blocks (on their way to disk, or on disk); otherwise they are
        dropped."""
        if need <= self.free():
            return 0
        moved = 0
        for seg_id in self.policy.victims(lambda s: not self.segments[s].leases):
            seg = self.segments[seg_id]
            self.leave_ram(seg_id, seg, evicted=True)
            moved += seg.live_count
            if self.on_evict is None or not self.on_evict(seg_id, seg, removed):
                self.forget_all(seg_id, seg, removed)
                self.drop_if_unused(seg_id, seg)
            if need <= self.free():
                break
        self.counters.evictions += moved
        return moved

    def unlease(self, seg_ids: list[int]) -> None:
        for seg_id in seg_ids:
            seg = self.segments.get(seg_id)
            if seg is not None:
                seg.leases -= 1
                self.drop_if_unused(seg_id, seg)

    # ------------------------------------------------------------------ figures
    def held(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, shards, nshards) of every live block, whatever its tier."""
        parts = []
        for seg in self.segments.values():
            if seg.live_count:
                pos = np.flatnonzero(seg.live)
                m = seg.meta
                parts.append((m.ids[pos], m.shards[pos], m.nshards[pos]))
        if not parts:
            return _EMPTY, _EMPTY.astype(np.uint16), _EMPTY.astype(np.uint16)
        return tuple(np.concatenate([p[k] for p in parts]) for k in range(3))  # type: ignore[return-value]

    def figures(self) -> dict[str, int]:
        """Blocks by tier, bytes, metadata bytes and the counters (iterates the segments: for
        stats only)."""
        ram = spilling = disk_only = leased = 0
        meta_bytes = self.table.nbytes + self.policy.meta_nbytes()
        for seg in self.segments.values():
            meta_bytes += seg.meta.meta_nbytes + seg.hits.nbytes + seg.live.nbytes
            if seg.in_ram:
                ram += seg.live_count
                if seg.leases:
                    leased += seg.meta.nbytes
            elif seg.spill is not None:
                spilling += seg.live_count
            elif seg.ref is None:
                disk_only += seg.live_count
        return {
            "blocks": ram,
            "present_blocks": len(self.table),
            "spilling_blocks": spilling,
            "disk_only_blocks": disk_only,
            "leased_bytes": leased,  # of ``used``: segments readers hold (not evictable)
            "meta_bytes": int(meta_bytes),
            "bytes": self.used,
            "segments": len(self.segments),
            **{name: getattr(self.counters, name) for name in STATS_COUNTERS},
            **{f"policy_{name}": v for name, v in self.policy.stats().items()},
        }


_EMPTY = np.zeros(0, dtype=np.uint64)
