"""An index shard's engine tier: engines report what their own KV cache holds; entries expire.

Engines (:class:`~kvray.connector.reporter.EngineReporter`, in vLLM's scheduler process) send
each index shard its part of their cache's changes, in order (one call at a time, each waited
for), and an empty report at least every :data:`~kvray.meta.engine_table.REPORT_INTERVAL_S`. Slots
(bits of the holder masks) are given by shard 0 (:meth:`EngineTier.register`), one per engine
incarnation. An engine whose reports stop for :data:`~kvray.meta.engine_table.ENGINE_TTL_S` (killed,
hung, its node gone) is purged; a new incarnation on a slot, or a report the shard cannot
place, makes the engine send its whole cache again (``full``). Nothing here survives a shard
restart; the engines' next reports are refused and they resend everything.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from kvray.actors.changelog import ChangeLog
from kvray.meta.engine_table import ENGINE_TTL_S, MAX_REPLICAS, EngineHolders
from kvray.meta.messages import ReplicaInfo

logger = logging.getLogger(__name__)

__all__ = ["EngineTier"]


@dataclass
class _Engine:
    info: ReplicaInfo
    seen: float


class EngineTier:
    """Engine holders of one index shard, their reporters, and their expiry."""

    def __init__(self, shard: int, feed: ChangeLog, ttl_s: float = ENGINE_TTL_S) -> None:
        self.shard = shard
        self.holders = EngineHolders()
        self._feed = feed
        self._engines: dict[int, _Engine] = {}
        self.ttl_s = ttl_s
        self.expired = 0
        self.refused = 0
        #: Bumped at every change of the engines' set or figures, for the feed's replies.
        self.version = 0

    def replicas(self) -> dict[int, ReplicaInfo]:
        return {slot: e.info for slot, e in self._engines.items()}

    def register(self, key: str, node_id: str, incarnation: str) -> int:
        """The slot of engine ``key``'s ``incarnation`` (shard 0 decides; -1: all 64 taken).
        A new incarnation of a known key takes its old slot, dropping the old one's entries."""
        self.sweep()
        for slot, e in self._engines.items():
            if e.info.key == key:
                if e.info.incarnation != incarnation:
                    self._purge(slot, "replaced by a new incarnation")
                    break
                e.seen = time.monotonic()
                return slot
        else:
            free = [s for s in range(MAX_REPLICAS) if s not in self._engines]
            if not free:
                self.refused += 1
                return -1
            slot = free[0]
        self._engines[slot] = _Engine(
            ReplicaInfo(slot, key, node_id, incarnation), time.monotonic()
        )
        self.version += 1
        return slot

    def update(self, info: ReplicaInfo, add: np.ndarray, remove: np.ndarray, full: bool) -> bool:
        """An engine's report; False: not placed (unknown slot or incarnation without
        ``full``): the engine registers again and sends everything."""
        slot = info.slot
        if not 0 <= slot < MAX_REPLICAS:
            return False
        e = self._engines.get(slot)
        same = e is not None and (e.info.key, e.info.incarnation) == (info.key, info.incarnation)
        if not same:
            if not full:
                return False
            if e is not None:
                self._purge(slot, f"taken by {info.key}")
        if full:
            ids, masks = self.holders.replace(slot, add)
        else:
            r_ids, r_masks = self.holders.remove(slot, remove)
            a_ids, a_masks = self.holders.add(slot, add)
            ids, masks = np.concatenate((r_ids, a_ids)), np.concatenate((r_masks, a_masks))
        changed = e is None or e.info != info
        self._engines[slot] = _Engine(info, time.monotonic())
        self._feed.record_engine(ids, masks)
        if changed:
            self.version += 1
            if not ids.size:
                self._feed.notify()  # new figures (usage): long polls answer with them
        return True

    def drop(self, slot: int, incarnation: str) -> None:
        """A clean stop: the engine's entries go now."""
        e = self._engines.get(slot)
        if e is not None and e.info.incarnation == incarnation:
            self._purge(slot, "stopped")

    def sweep(self) -> int:
        """Purge engines silent for longer than ``ttl_s``; returns how many."""
        now = time.monotonic()
        late = [s for s, e in self._engines.items() if now - e.seen > self.ttl_s]
        for slot in late:
            self._purge(slot, f"silent for {self.ttl_s:.0f} s")
            self.expired += 1
        return len(late)

    def _purge(self, slot: int, why: str) -> None:
        e = self._engines.pop(slot, None)
        ids, masks = self.holders.purge(slot)
        self._feed.record_engine(ids, masks)
        self.version += 1
        if not ids.size:
            self._feed.notify()  # the replicas' table changed: long polls answer it
        if e is not None:
            logger.info(
                "kvray index %d: engine %s (slot %d) dropped (%s): %d blocks",
                self.shard,
                e.info.key,
                slot,
                why,
                ids.size,
            )

    def stats(self) -> dict[str, int]:
        return {
            "engines": len(self._engines),
            "engine_blocks": len(self.holders),
            "engine_bytes": self.holders.nbytes,
            "engines_expired": self.expired,
            "engines_refused": self.refused,
        }
