"""The scheduler side's one view of kvray (in the style of vLLM's ``OffloadingManager``).

It owns the subscription to the index (the store's view and feed) and offers what the
scheduler needs, all answered locally without an actor call:

- ``lookup(block_hashes)``: how many leading blocks are present (every shard stored);
  ``find(block_hashes)`` also in the groupings other TP sizes store (reuse across TP sizes);
- ``prepare_load(block_hashes, grouping)``: where each block lives, for the workers (they keep
  no view);
- ``complete_store(...)``: a store job finished on every rank;
- ``take_events()``: vLLM KV events, built only when ``kv_events_config`` asks for them, from
  the change feed's additions and removals (no scan of everything announced).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvray.connector.keyspace import EngineKeySpace
from kvray.connector.sides import ViewStore
from kvray.meta.holders import PLACEMENT_BASE, split_positions
from kvray.meta.idtable import IdTable

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent

    from kvray.meta.view import LocalView

__all__ = ["KVRayCacheManager", "LoadPlan"]

#: Blocks announced as stored that ``BlockRemoved`` can still be reported for.
MAX_ANNOUNCED = 1 << 20
#: Stored blocks waiting for the feed to show them before ``BlockStored`` is emitted.
MAX_PENDING = 1 << 16
#: Events kept for ``take_events`` (the engine drains them every step).
MAX_EVENTS = 1 << 16


@dataclass
class LoadPlan:
    """Where the blocks of one load live, self-contained: a location code per block, the pool
    of every slot it names, and the shard slots of each split block (in the order of the split
    positions of ``locs``). Placement codes are numbered per index shard, so a plan never
    leans on a code table shared with other plans."""

    locs: list[int]
    pools: dict[int, str] = field(default_factory=dict)
    placements: list[tuple[int, ...]] = field(default_factory=list)


@dataclass
class _Stored:
    ids: np.ndarray
    hashes: list[bytes]
    token_ids: list[int]
    parent: bytes | None


class KVRayCacheManager:
    """Lookups, load planning and KV events over the store's local view."""

    def __init__(
        self, key_space: EngineKeySpace, store: ViewStore, *, events: bool = False
    ) -> None:
        self.key_space = key_space
        self.store = store
        self.view: LocalView = store.local_view()
        self.block_size = key_space.block_size
        self.events_enabled = events
        self._lock = threading.Lock()
        self._pending: deque[_Stored] = deque()
        self._pending_blocks = 0
        self._announced = IdTable({"ring": np.int64})
        self._ring: list[bytes | None] = []
        self._ring_next = 0
        self._events: deque[KVCacheEvent] = deque(maxlen=MAX_EVENTS)
        if events:
            self.view.listener = self._on_feed

    # ------------------------------------------------------------------ lookups
    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        """Longest prefix of blocks present in kvray (every shard stored; local view)."""
        if not block_hashes:
            return 0
        return self.store.lookup(self.key_space.block_keys(block_hashes))

    def find(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """Longest prefix of blocks present in one grouping, and that grouping.

        The engine's own grouping first: a same-TP hit costs one lookup, as without reuse
        across TP sizes. Another grouping is looked up in full only when it holds the block
        where the best so far stops (one id each otherwise), so a miss costs one id per
        grouping more; ties go to the grouping tried first."""
        ks = self.key_space
        best, grouping = self.lookup(block_hashes), ks.num_shards
        if best == len(block_hashes) or len(ks.groupings) == 1:
            return best, grouping
        view = self.view
        found = best
        for g in ks.groupings[1:]:
            if not view.contains(ks.block_ids(block_hashes[best : best + 1], g))[0]:
                continue
            n = view.lookup(ks.block_ids(block_hashes, g))
            if n > best:
                best, grouping = n, g
            if best == len(block_hashes):
                break
        if best > found:  # the store counted these blocks as misses
            self.store.count(hit_blocks=best - found, miss_blocks=found - best)
        return best, grouping

    def present(self, block_hashes: Sequence[bytes]) -> np.ndarray:
        """Which of these blocks are present (for skipping stores)."""
        return self.view.contains(self.key_space.block_ids(block_hashes))

    def prepare_load(self, block_hashes: Sequence[bytes], grouping: int = 0) -> LoadPlan:
        """Where each block (stored in ``grouping`` shards; 0: the engine's own) lives now. A
        block that vanished since the lookup gets code 0: the workers report it failed and
        vLLM recomputes it."""
        ids = self.key_space.block_ids(block_hashes, grouping)
        view = self.view
        locs = view.locs(ids).astype(np.int64)
        split = split_positions(locs)
        resolved = view.placements_of(ids[split], locs[split])
        for i, t in zip(split.tolist(), resolved, strict=True):
            if t is None:
                locs[i] = 0
        plan = LoadPlan(locs.tolist(), placements=[t for t in resolved if t is not None])
        slots = set((locs[locs < PLACEMENT_BASE] - 1).tolist()) - {-1}
        for t in plan.placements:
            slots.update(t)
        nodes = view.nodes
        plan.pools = {s: nodes[s].pool_name for s in slots if s in nodes}
        return plan

    # ------------------------------------------------------------------ events
    def complete_store(
        self, block_hashes: list[bytes], token_ids: list[int], parent: bytes | None
    ) -> None:
        """A store job finished on every rank: its blocks are announced (``BlockStored``) once
        the feed shows them present."""
        if not self.events_enabled or not block_hashes:
            return
        ids = self.key_space.block_ids(block_hashes)
        with self._lock:
            while self._pending and self._pending_blocks + len(ids) > MAX_PENDING:
                self._pending_blocks -= int(self._pending.popleft().ids.size)
            self._pending.append(_Stored(ids, list(block_hashes), token_ids, parent))
            self._pending_blocks += int(ids.size)

    def _on_feed(self, added: np.ndarray, removed: np.ndarray) -> None:
        """Feed thread: blocks that left kvray become ``BlockRemoved`` if we announced them."""
        if not removed.size:
            return
        with self._lock:
            slots = self._announced.find(removed)
            hit = slots >= 0
            if not hit.any():
                return
            ring = self._announced.cols["ring"][slots[hit]].tolist()
            self._announced.delete_slots(slots[hit])
            hashes = [self._ring[i] for i in ring]
            for i in ring:
                self._ring[i] = None
        self._emit_removed([h for h in hashes if h is not None])

    def take_events(self) -> list[KVCacheEvent]:
        if not self.events_enabled:
            return []
        with self._lock:
            ready: list[_Stored] = []
            keep: deque[_Stored] = deque()
            for job in self._pending:
                (ready if self.view.contains(job.ids).all() else keep).append(job)
            self._pending = keep
            self._pending_blocks = sum(int(j.ids.size) for j in keep)
            for job in ready:
                self._announce(job)
            events = list(self._events)
            self._events.clear()
        return events

    def _announce(self, job: _Stored) -> None:
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        n = int(job.ids.size)
        if not self._ring:
            self._ring = [None] * MAX_ANNOUNCED
        idx = (np.arange(n) + self._ring_next) % MAX_ANNOUNCED
        self._ring_next = int((self._ring_next + n) % MAX_ANNOUNCED)
        stale = [(i, h) for i in idx.tolist() if (h := self._ring[i]) is not None]
        if stale:  # the ring is full: the oldest announcements are forgotten
            slots = self._announced.find(self.key_space.block_ids([h for _, h in stale]))
            pos = np.array([i for i, _ in stale])
            mine = (slots >= 0) & (self._announced.cols["ring"][slots] == pos)
            self._announced.delete_slots(slots[mine])
        for i, h in zip(idx.tolist(), job.hashes, strict=True):
            self._ring[i] = h
        self._announced.upsert(job.ids, ring=idx)
        self._events.append(
            BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in job.hashes],  # type: ignore[arg-type]
                parent_block_hash=maybe_convert_block_hash(job.parent)  # type: ignore[arg-type]
                if job.parent is not None
                else None,
                token_ids=job.token_ids,
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM_CPU,
                lora_name=None,
            )
        )

    def _emit_removed(self, hashes: list[bytes]) -> None:
        if not hashes:
            return
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        converted = [maybe_convert_block_hash(h) for h in hashes]  # type: ignore[arg-type]
        with self._lock:
            self._events.append(BlockRemoved(block_hashes=converted, medium=MEDIUM_CPU))

    # ------------------------------------------------------------------ figures
    def sizes(self) -> dict[str, int]:
        """Sizes of the manager's bounded containers (tests, gauges)."""
        with self._lock:
            return {
                "pending_blocks": self._pending_blocks,
                "announced": len(self._announced),
                "events": len(self._events),
            }

    def close(self) -> None:
        if self.view.listener == self._on_feed:
            self.view.listener = None
