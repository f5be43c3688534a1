"""Eviction policies of a pool's RAM (issue 35), Ray-free: what goes first when a pool is full.

A policy ranks *entries* (the pool's segments: the blocks of one put, stored and evicted
together; a simulator may make every block an entry) and never holds their bytes. The pool
tells it what enters RAM (:meth:`EvictionPolicy.insert`), what a read touched, in the order of
the prefix it read (:meth:`~EvictionPolicy.touch`), and what left RAM (:meth:`~EvictionPolicy.
remove`); when a put needs room it takes :meth:`~EvictionPolicy.victims` in order, skipping
those it may not evict (leased).

- ``lru``: least recently used first; a read touches the chain's tail first and its head last,
  so a chain's tail always goes before its head.
- ``probation``: new entries wait in a small FIFO (a tenth of the capacity) until a read moves
  them to the main LRU; what the FIFO evicts leaves a *ghost* (its first block id, in a bounded
  ring of 9 bytes each), and an entry put again while its ghost is remembered goes straight to
  main (S3-FIFO / 2Q). A scan of one-off prompts passes through the FIFO without flushing the
  chains that are read again.
- ``adaptive``: ``probation`` whose FIFO share follows what the pool's own traffic says LRU
  would have done, priced by exact LRU stack distances over the entries and ghosts it tracks:
  a FIFO ghost put again within the capacity's worth of distance is a hit LRU would have had
  (the FIFO grows), a read of a main entry from beyond it is one LRU would have lost (the FIFO
  shrinks). Tight caches keep the doorkeeper; roomy ones drift towards recency.
- ``aged``: probation and main ranked together by age, probation's ages weighted by a factor
  the same evidence moves; at 1 it is exactly LRU, so a roomy cache loses nothing to the
  doorkeeper (:class:`AgedPolicy`).

Pools share their ghosts through the index shards (:mod:`kvray.meta.ghosts`): a segment put
again on another node than the one that evicted it still skips probation, and the evicting
pool's policy still gets the evidence (:meth:`EvictionPolicy.ghost_returned`).

:func:`simulate` replays a request trace (each request a list of block ids, a chain) through
one policy offline, for tuning and for ``scripts/bench_trace.py``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvray.meta.ghosts import ClusterGhosts

__all__ = [
    "POLICIES",
    "AdaptivePolicy",
    "AgedPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "ProbationPolicy",
    "SimResult",
    "make_policy",
    "simulate",
]

#: The names ``eviction_policy`` accepts.
POLICIES = ("lru", "probation", "adaptive", "aged")


class EvictionPolicy:
    """What a pool's RAM evicts first. Entry ids are ints chosen by the caller (unique while
    the entry is in RAM); sizes are bytes. Not thread-safe (the pool holds its lock)."""

    name = "base"

    def insert(self, eid: int, nbytes: int, nblocks: int, key: int = 0) -> None:
        """An entry entered RAM. ``key``: a stable id of its first block (for ghosts)."""
        raise NotImplementedError

    def touch(self, eids: Sequence[int], hit_bytes: Sequence[int]) -> None:
        """A read served ``hit_bytes[i]`` from entry ``eids[i]``; ``eids`` in the order of
        the prefix read (its head first), each at most once."""
        raise NotImplementedError

    def remove(self, eid: int, evicted: bool = False) -> None:
        """The entry left RAM: ``evicted`` by the policy's choice, else dropped (no effect
        for an unknown id)."""
        raise NotImplementedError

    def victims(self, evictable: Callable[[int], bool]) -> Iterator[int]:
        """Entries to evict, best first, each ``evictable``. The caller evicts (and
        :meth:`remove` s) each one before asking for the next; it may stop at any time."""
        raise NotImplementedError

    def take_ghosts(self) -> list[int]:
        """Keys of the entries evicted since the last call that left a ghost here: what a
        pool tells the cluster (:class:`kvray.meta.ghosts.ClusterGhosts`), so an
        entry put again on another node finds its ghost. Empty for policies without ghosts."""
        return []

    def promote(self, key: int) -> bool:
        """The cluster says the entry whose key is ``key`` came back while its ghost was
        remembered elsewhere: treat it as a ghost hit (no effect where the policy has no
        ghosts, or the entry is not in probation). True if moved."""
        return False

    def ghost_returned(self, key: int) -> None:
        """A ghost evicted here (``key``) came back in another pool: the evidence this pool's
        own traffic would have given, had it come back here."""

    def demote(self, eid: int) -> None:
        """The entry is a copy no reader sees (another pool's copy of its blocks is the one
        read): evict it first (no effect for an unknown id)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        """Counters by reason (``evicted_unread``: never read since entering RAM;
        ``evicted_read``: read at least once; ``ghost_hits``: put again while remembered)."""
        return {}

    def meta_nbytes(self) -> int:
        """Bytes of this policy's bookkeeping (Python objects included, approximately)."""
        return 0


class LRUPolicy(EvictionPolicy):
    """Least recently used first (an ``OrderedDict``, oldest first)."""

    name = "lru"

    def __init__(self) -> None:
        self._od: OrderedDict[int, int] = OrderedDict()  # eid -> times read
        self.evicted_unread = 0
        self.evicted_read = 0

    def __len__(self) -> int:
        return len(self._od)

    def insert(self, eid: int, nbytes: int, nblocks: int, key: int = 0) -> None:
        self._od[eid] = 0
        self._od.move_to_end(eid)

    def touch(self, eids: Sequence[int], hit_bytes: Sequence[int]) -> None:
        od = self._od
        for eid in reversed(eids):  # the head ends most recent: tails go first
            if eid in od:
                od[eid] += 1
                od.move_to_end(eid)

    def remove(self, eid: int, evicted: bool = False) -> None:
        reads = self._od.pop(eid, None)
        if evicted and reads is not None:
            if reads:
                self.evicted_read += 1
            else:
                self.evicted_unread += 1

    def demote(self, eid: int) -> None:
        if eid in self._od:
            self._od.move_to_end(eid, last=False)

    def victims(self, evictable: Callable[[int], bool]) -> Iterator[int]:
        for eid in list(self._od):
            if eid in self._od and evictable(eid):
                yield eid

    def stats(self) -> dict[str, int]:
        return {"evicted_unread": self.evicted_unread, "evicted_read": self.evicted_read}

    def meta_nbytes(self) -> int:
        # An OrderedDict item with its ints: 156 B (tracemalloc, 20,000 entries).
        return 156 * len(self._od)


# ---------------------------------------------------------------------- probation + ghosts
class _Ghosts:
    """First block ids of entries evicted lately, with where they were evicted from: a ring
    of at most ``limit()`` (9 bytes each), searched with one numpy comparison."""

    def __init__(self) -> None:
        self.keys = np.zeros(64, dtype=np.uint64)
        self.main = np.zeros(64, dtype=np.bool_)
        self.at = 0

    def add(self, key: int, main: bool, limit: int) -> None:
        if limit > len(self.keys):
            new = min(limit, 2 * len(self.keys))
            keys = np.zeros(new, dtype=np.uint64)
            where = np.zeros(new, dtype=np.bool_)
            keys[: len(self.keys)] = self.keys
            where[: len(self.main)] = self.main
            self.keys, self.main = keys, where
        i = self.at % len(self.keys)
        self.keys[i] = np.uint64(key)
        self.main[i] = main
        self.at = i + 1

    def pop(self, key: int) -> bool | None:
        """Where the ghost of ``key`` was evicted from (True: main), forgetting it; None when
        there is none."""
        at = np.flatnonzero(self.keys == np.uint64(key))
        if not at.size:
            return None
        i = int(at[-1])
        self.keys[i] = 0
        return bool(self.main[i])

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.main.nbytes)


class ProbationPolicy(EvictionPolicy):
    """New entries wait in a small FIFO (*probation*, a share ``p`` of the capacity); one
    read moves an entry to the main LRU; what probation evicts leaves a *ghost*, and an entry
    put again while its ghost is remembered goes straight to main (S3-FIFO / 2Q). So a scan of
    one-off prompts passes through probation without flushing the chains that are read again.
    Reads touch a chain's tail first and its head last, so within either
    queue a chain's tail goes before its head.

    Per entry an ``OrderedDict`` item (id -> bytes, signed: negative in probation); per ghost
    9 bytes, at most ``ghosts`` per entry in RAM."""

    name = "probation"

    def __init__(self, capacity: int, *, share: float = 0.1, ghosts: int = 4) -> None:
        self.capacity = max(1, int(capacity))
        self.share = share
        self._ghosts_per_entry = ghosts
        self._prob: OrderedDict[int, int] = OrderedDict()  # eid -> bytes, oldest first
        self._main: OrderedDict[int, int] = OrderedDict()  # eid -> bytes, least recent first
        self._prob_bytes = 0
        self._keys: dict[int, int] = {}  # eid -> first block id
        self._eid_of: dict[int, int] = {}  # first block id -> eid (for the cluster's news)
        self._ghosts = _Ghosts()
        self.evicted_unread = 0  # from probation: never read
        self.evicted_read = 0  # from main
        self.promoted = 0  # read in probation: moved to main
        self.ghost_hits = 0
        self.cluster_ghost_hits = 0  # put again here, the ghost remembered elsewhere
        self.ghosts_returned = 0  # ghosts of ours put again elsewhere
        self.demoted = 0  # copies no reader sees (another pool's copy is read)
        self._evicted: list[int] = []  # keys of ghosts not yet taken (keep_evicted)
        self.keep_evicted = False  # a pool that shares its ghosts sets this

    def __len__(self) -> int:
        return len(self._prob) + len(self._main)

    def insert(self, eid: int, nbytes: int, nblocks: int, key: int = 0) -> None:
        self.remove(eid)
        nbytes = max(1, int(nbytes))
        was = self._ghosts.pop(key) if key else None
        if key:
            self._keys[eid] = key
            self._eid_of[key] = eid
        if was is None:
            self._prob[eid] = nbytes
            self._prob_bytes += nbytes
            return
        self.ghost_hits += 1
        self._came_back(key, was, nbytes)
        self._main[eid] = nbytes

    def _came_back(self, key: int, from_main: bool, nbytes: int) -> None:
        """An entry was put again while its ghost (evicted from main, or from probation) was
        remembered."""

    def touch(self, eids: Sequence[int], hit_bytes: Sequence[int]) -> None:
        for eid in reversed(eids):  # the head ends most recent: tails go first
            nbytes = self._prob.pop(eid, None)
            if nbytes is not None:
                self._prob_bytes -= nbytes
                self._main[eid] = nbytes
                self.promoted += 1
            elif eid in self._main:
                self._main.move_to_end(eid)

    def remove(self, eid: int, evicted: bool = False) -> None:
        key = self._keys.pop(eid, 0)
        if key and self._eid_of.get(key) == eid:
            del self._eid_of[key]
        nbytes = self._prob.pop(eid, None)
        main = nbytes is None
        if nbytes is not None:
            self._prob_bytes -= nbytes
        elif self._main.pop(eid, None) is None:
            return
        if not evicted:
            return
        if main:
            self.evicted_read += 1
        else:
            self.evicted_unread += 1
        if key:
            self._ghosts.add(key, main, max(64, self._ghosts_per_entry * len(self)))
            if self.keep_evicted:
                self._evicted.append(key)

    def take_ghosts(self) -> list[int]:
        out, self._evicted = self._evicted, []
        return out

    def promote(self, key: int) -> bool:
        eid = self._eid_of.get(key)
        nbytes = self._prob.pop(eid, None) if eid is not None else None
        if nbytes is None:
            return False
        self._prob_bytes -= nbytes
        self._main[eid] = nbytes
        self.cluster_ghost_hits += 1
        return True

    def ghost_returned(self, key: int) -> None:
        was = self._ghosts.pop(key)
        if was is not None:
            self.ghosts_returned += 1
            self._came_back(key, was, 0)

    def demote(self, eid: int) -> None:
        nbytes = self._main.pop(eid, None)
        if nbytes is not None:  # back to probation, at its head
            self._prob[eid] = nbytes
            self._prob_bytes += nbytes
        elif eid not in self._prob:
            return
        self._prob.move_to_end(eid, last=False)
        self.demoted += 1

    def victims(self, evictable: Callable[[int], bool]) -> Iterator[int]:
        skipped: set[int] = set()  # not evictable now (leased): asked once per call
        while True:
            prob_first = self._prob_bytes > self.share * self.capacity or not self._main
            found = None
            for queue in (self._prob, self._main) if prob_first else (self._main, self._prob):
                for eid in queue:
                    if eid in skipped:
                        continue
                    if evictable(eid):
                        found = eid
                        break
                    skipped.add(eid)
                if found is not None:
                    break
            if found is None:
                return
            yield found

    def stats(self) -> dict[str, int]:
        return {
            "evicted_unread": self.evicted_unread,
            "evicted_read": self.evicted_read,
            "promoted": self.promoted,
            "ghost_hits": self.ghost_hits,
            "cluster_ghost_hits": self.cluster_ghost_hits,
            "ghosts_returned": self.ghosts_returned,
            "demoted": self.demoted,
            "probation_share_pct": round(100 * self.share),
        }

    def meta_nbytes(self) -> int:
        # An OrderedDict item and a dict item with their ints: 257 B (tracemalloc, 20,000
        # entries), a second dict item (~100 B: key -> entry), plus the ghosts' ring.
        return 357 * len(self) + self._ghosts.nbytes


# ---------------------------------------------------------------------- adaptive
class _Recency:
    """When each tracked item (an entry in RAM, or a ghost) was last used, with its bytes, in
    numpy slots: an item's LRU stack distance (the bytes of every tracked item used since) is
    one comparison and one sum."""

    def __init__(self) -> None:
        self.seq = np.full(64, -1, dtype=np.int64)
        self.nbytes = np.zeros(64, dtype=np.float64)
        self._free = list(range(63, -1, -1))
        self._now = 0

    def add(self, nbytes: int) -> int:
        if not self._free:
            n = len(self.seq)
            self.seq = np.concatenate([self.seq, np.full(n, -1, dtype=np.int64)])
            self.nbytes = np.concatenate([self.nbytes, np.zeros(n)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        slot = self._free.pop()
        self.nbytes[slot] = nbytes
        self.use(slot)
        return slot

    def use(self, slot: int) -> None:
        self._now += 1
        self.seq[slot] = self._now

    @property
    def now(self) -> int:
        """The last use's sequence number (a use is an insertion or a read)."""
        return self._now

    def since(self, slot: int) -> float:
        """Bytes of the items used after ``slot`` last was."""
        return float(self.nbytes[self.seq > self.seq[slot]].sum())

    def drop(self, slot: int) -> None:
        self.seq[slot] = -1
        self.nbytes[slot] = 0
        self._free.append(slot)

    @property
    def size(self) -> int:
        return int(self.seq.nbytes + self.nbytes.nbytes)


class AdaptivePolicy(ProbationPolicy):
    """``probation`` whose FIFO share (between ``low`` and ``high``, starting at ``low``)
    follows what one LRU of the same capacity would have done with the pool's own traffic. The
    stack distance of an entry or a ghost is the bytes of every tracked item used since it was
    (:class:`_Recency`), so LRU would hold it again iff that is at most the capacity:

    - a ghost evicted from probation put again within the capacity is a hit LRU would have
      had and probation lost: the share grows by the entry's part of the capacity;
    - a read of a main entry from beyond the capacity is a hit LRU would have lost: the
      share shrinks by the bytes read's part.

    A tight cache, where what is reused comes back after more than its capacity of traffic,
    keeps the doorkeeper; a roomy one, where LRU would have held the one-off puts' next use,
    drifts towards recency. Bookkeeping over ``probation``: a numpy slot (16 bytes) and a dict
    item per entry and per ghost."""

    name = "adaptive"

    def __init__(
        self, capacity: int, *, low: float = 0.02, high: float = 0.5, ghosts: int = 4
    ) -> None:
        super().__init__(capacity, share=low, ghosts=ghosts)
        self.low, self.high = low, high
        self._rec = _Recency()
        self._slot: dict[int, int] = {}  # eid -> slot
        self._ghost_slot: dict[int, int] = {}  # ghost key -> slot, oldest first
        self.lru_would_hit = 0  # probation's misses LRU would have hit
        self.lru_would_miss = 0  # main's hits LRU would have missed

    def _came_back(self, key: int, from_main: bool, nbytes: int) -> None:
        slot = self._ghost_slot.pop(key, None)
        if slot is None:
            return
        if not from_main and self._rec.since(slot) <= self.capacity:
            self.lru_would_hit += 1
            self._lru_would_hit(nbytes or float(self._rec.nbytes[slot]))  # 0: its ghost's size
        self._rec.drop(slot)

    def _lru_would_hit(self, nbytes: float) -> None:
        """Probation lost ``nbytes`` that LRU would have kept: the FIFO grows."""
        self.share = min(self.high, self.share + nbytes / self.capacity)

    def _lru_would_miss(self, nbytes: float) -> None:
        """Main served ``nbytes`` that LRU would have lost: the FIFO shrinks."""
        self.share = max(self.low, self.share - nbytes / self.capacity)

    def insert(self, eid: int, nbytes: int, nblocks: int, key: int = 0) -> None:
        super().insert(eid, nbytes, nblocks, key)
        stale = self._ghost_slot.pop(key, None) if key else None  # the ring forgot it
        if stale is not None:
            self._rec.drop(stale)
        self._slot[eid] = self._rec.add(max(1, int(nbytes)))

    def touch(self, eids: Sequence[int], hit_bytes: Sequence[int]) -> None:
        for eid, hit in zip(eids, hit_bytes, strict=True):
            slot = self._slot.get(eid)
            if (
                hit
                and slot is not None
                and eid in self._main
                and self._rec.since(slot) > self.capacity
            ):
                self.lru_would_miss += 1
                self._lru_would_miss(hit)
        super().touch(eids, hit_bytes)
        for eid in reversed(eids):  # the head used last, as the queues order them
            slot = self._slot.get(eid)
            if slot is not None:
                self._rec.use(slot)

    def demote(self, eid: int) -> None:
        super().demote(eid)
        slot = self._slot.get(eid)
        if slot is not None and eid in self._prob:
            self._rec.seq[slot] = 0  # the oldest: ``aged`` ranks by age

    def remove(self, eid: int, evicted: bool = False) -> None:
        key = self._keys.get(eid, 0)
        slot = self._slot.pop(eid, None)
        super().remove(eid, evicted)
        if slot is None:
            return
        if not (evicted and key):
            self._rec.drop(slot)
            return
        old = self._ghost_slot.pop(key, None)
        if old is not None:
            self._rec.drop(old)
        self._ghost_slot[key] = slot
        limit = max(64, self._ghosts_per_entry * len(self))
        while len(self._ghost_slot) > limit:
            self._rec.drop(self._ghost_slot.pop(next(iter(self._ghost_slot))))

    def stats(self) -> dict[str, int]:
        return {
            **super().stats(),
            "lru_would_hit": self.lru_would_hit,
            "lru_would_miss": self.lru_would_miss,
        }

    def meta_nbytes(self) -> int:
        # Two dict items with their ints (~100 B each, as above) and the numpy slots.
        tracked = len(self._slot) + len(self._ghost_slot)
        return super().meta_nbytes() + 100 * tracked + self._rec.size


class AgedPolicy(AdaptivePolicy):
    """Probation and main ranked together by age: the victim is the older of probation's
    oldest entry and main's least recent one, probation's age multiplied by a weight ``k``
    (between ``low`` and ``high``, starting at ``start``). At ``k = 1`` this is exactly LRU
    over the segments (an unread entry's last use is its insertion); as ``k`` grows, entries
    never read go first, as in ``probation``. The same evidence as ``adaptive`` moves ``k``
    (exact LRU stack distances over the entries and ghosts it tracks):

    - a ghost evicted from probation that comes back within the capacity is a hit LRU would
      have had: ``k`` shrinks by ``exp(gain x bytes / capacity)``;
    - a read of a main entry from beyond the capacity is a hit LRU would have lost: ``k``
      grows by the same rule with the bytes read.

    Unlike a FIFO share, the weight reaches LRU itself, so a roomy cache does not pay for the
    doorkeeper; it starts above 1 because exact LRU gives no evidence either way (nothing it
    keeps is read from beyond its capacity, nothing it evicts from probation comes back within
    it). Bookkeeping: that of ``adaptive``."""

    name = "aged"

    def __init__(
        self,
        capacity: int,
        *,
        start: float = 2.0,
        low: float = 1.0,
        high: float = 1e4,
        gain: float = 4.0,
        ghosts: int = 4,
    ) -> None:
        super().__init__(capacity, ghosts=ghosts)
        self._log_k = math.log(start)
        self._log_low, self._log_high = math.log(low), math.log(high)
        self.gain = gain

    @property
    def weight(self) -> float:
        return math.exp(self._log_k)

    def _shift(self, nbytes: float) -> None:
        """Move ``log k`` by ``gain x nbytes / capacity`` (negative: towards LRU)."""
        log_k = self._log_k + self.gain * nbytes / self.capacity
        self._log_k = min(self._log_high, max(self._log_low, log_k))

    def _lru_would_hit(self, nbytes: float) -> None:
        self._shift(-nbytes)

    def _lru_would_miss(self, nbytes: float) -> None:
        self._shift(nbytes)

    def victims(self, evictable: Callable[[int], bool]) -> Iterator[int]:
        skipped: set[int] = set()  # not evictable now (leased): asked once per call

        def oldest(queue: OrderedDict[int, int]) -> int | None:
            for eid in queue:
                if eid in skipped:
                    continue
                if evictable(eid):
                    return eid
                skipped.add(eid)
            return None

        while True:
            prob, main = oldest(self._prob), oldest(self._main)
            if prob is None or main is None:
                found = main if prob is None else prob
                if found is None:
                    return
                yield found
                continue
            rec = self._rec
            age_prob = rec.now - int(rec.seq[self._slot[prob]])
            age_main = rec.now - int(rec.seq[self._slot[main]])
            yield prob if age_prob * self.weight >= age_main else main

    def stats(self) -> dict[str, int]:
        out = super().stats()
        out.pop("probation_share_pct", None)
        out["probation_weight_pct"] = round(100 * self.weight)
        return out


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called ``name`` (one of :data:`POLICIES`) for ``capacity`` bytes of RAM."""
    if name == "lru":
        return LRUPolicy()
    if name == "probation":
        return ProbationPolicy(capacity)
    if name == "adaptive":
        return AdaptivePolicy(capacity)
    if name == "aged":
        return AgedPolicy(capacity)
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {POLICIES}")


# ---------------------------------------------------------------------- offline replay
@dataclass
class SimResult:
    hit_blocks: int
    total_blocks: int
    evicted_entries: int
    max_used: int  # the most blocks held at once (never above the capacity)

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


def simulate(
    requests: Iterable[Sequence[int]],
    capacity_blocks: int,
    policy: EvictionPolicy | str,
    *,
    per_block: bool = False,
    nodes: int = 1,
    placement: str = "own",
    shared_ghosts: bool = False,
    chunk: int = 0,
) -> SimResult:
    """Replay requests (chains of block ids) through one cache of ``capacity_blocks`` blocks
    of one byte each ruled by ``policy``: each request hits the longest cached prefix, reads
    it (a touch, in order) and puts the blocks after it that are not held as one entry (a
    segment, as a pool stores a put), or one entry per block with ``per_block``. An entry
    that cannot fit is cut to the longest run that does (as a pool does).

    With ``nodes`` > 1 (``policy`` a name), as ``scripts/bench_trace.py``'s replay runs the
    pools: ``nodes`` caches of ``capacity_blocks // nodes`` blocks, requests round robin, the
    longest prefix held in any of them hit (each touches what it served), the rest put into
    the request's own; with ``placement="home"``, into the pool holding the last block hit
    (none hit: a hash of the first block's), so a prefix's blocks and ghosts stay together.
    With ``shared_ghosts``, the pools' ghosts are one cluster's (as the index shards keep them,
    :class:`kvray.meta.ghosts.ClusterGhosts`): an entry put while another pool remembers its
    ghost is promoted, and that pool gets the evidence. ``chunk`` > 0 cuts a put into entries
    of at most that many blocks (a pool's ``segment_bytes``), inserted tail first."""
    if nodes > 1 and not isinstance(policy, str):
        raise ValueError("simulate: several nodes need a policy name (one policy each)")
    if placement not in ("own", "home"):
        raise ValueError(f"simulate: placement is 'own' or 'home', not {placement!r}")
    cap = capacity_blocks // nodes
    pols = [make_policy(policy, cap) if isinstance(policy, str) else policy for _ in range(nodes)]
    cluster = ClusterGhosts() if shared_ghosts else None
    if cluster is not None:
        for pol in pols:
            pol.keep_evicted = True
    where: dict[int, tuple[int, int]] = {}  # block -> (node, entry)
    blocks_of: dict[int, list[int]] = {}
    used = [0] * nodes
    max_used = hit = total = evicted = 0
    next_eid = 1

    def evictable(eid: int) -> bool:
        return True

    for i, req in enumerate(requests):
        n = 0
        for x in req:
            if x not in where:
                break
            n += 1
        hit += n
        total += len(req)
        touched: dict[int, tuple[list[int], list[int]]] = {}  # node -> (entries, blocks read)
        for x in req[:n]:
            node, e = where[x]
            eids, counts = touched.setdefault(node, ([], []))
            if eids and eids[-1] == e:
                counts[-1] += 1
            elif e not in eids:
                eids.append(e)
                counts.append(1)
        for node, (eids, counts) in touched.items():
            pols[node].touch(eids, counts)
        if placement == "own" or not req:
            me = i % nodes
        elif n:
            me = where[req[n - 1]][0]
        else:  # a 64-bit multiplicative hash: trace ids are small consecutive integers
            me = (((req[0] * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> 32) % nodes
        pol = pols[me]
        new = [x for x in dict.fromkeys(req[n:]) if x not in where]
        if per_block:
            groups = [[x] for x in new]
        elif chunk > 0:  # tail first: within a put, the head is the most recent
            groups = [new[j : j + chunk] for j in range(0, len(new), chunk)][::-1]
        else:
            groups = [new] if new else []
        for group in groups:
            need = len(group)
            if used[me] + need > cap:
                for victim in pol.victims(evictable):
                    gone = blocks_of.pop(victim)
                    for x in gone:
                        del where[x]
                    used[me] -= len(gone)
                    pol.remove(victim, evicted=True)
                    evicted += 1
                    if cluster is not None:
                        cluster.evicted(me, pol.take_ghosts())
                    if used[me] + need <= cap:
                        break
            group = group[: max(0, cap - used[me])]
            if not group:
                continue
            eid = next_eid
            next_eid += 1
            blocks_of[eid] = group
            for x in group:
                where[x] = (me, eid)
            used[me] += len(group)
            max_used = max(max_used, used[me])
            pol.insert(eid, len(group), len(group), key=group[0] + 2)
            if cluster is not None:
                for slot, key in zip(*cluster.added(me, [group[0] + 2]), strict=True):
                    pols[me].promote(int(key))
                    if slot != me:
                        pols[int(slot)].ghost_returned(int(key))
    return SimResult(hit, total, evicted, max_used)
