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
  ring of 25 bytes each: :mod:`kvray.meta.admission`), and an entry put again while its ghost
  is remembered goes straight to main (S3-FIFO / 2Q). A scan of one-off prompts passes
  through the FIFO without flushing the chains that are read again.
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

from kvray.meta.admission import MAIN, PROBATION, EntryArena, GhostRing
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
class ProbationPolicy(EvictionPolicy):
    """New entries wait in a small FIFO (*probation*, a share ``p`` of the capacity); one
    read moves an entry to the main LRU; what probation evicts leaves a *ghost*, and an entry
    put again while its ghost is remembered goes straight to main (S3-FIFO / 2Q). So a scan of
    one-off prompts passes through probation without flushing the chains that are read again.
    Reads touch a chain's tail first and its head last, so within either
    queue a chain's tail goes before its head.

    Bookkeeping in numpy (:mod:`kvray.meta.admission`): a row of ~45 bytes and ~40 bytes of id
    tables per entry, 25 bytes per ghost, at most ``ghosts`` per entry."""

    name = "probation"

    def __init__(self, capacity: int, *, share: float = 0.1, ghosts: int = 4) -> None:
        self.capacity = max(1, int(capacity))
        self.share = share
        self._ghosts_per_entry = ghosts
        self._arena = EntryArena()
        self._ghosts = GhostRing()
        self._now = 0  # the last use's sequence number (a use is an insertion or a read)
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
        return len(self._arena)

    @property
    def _prob_bytes(self) -> int:
        return self._arena.bytes[PROBATION]

    def _use(self, r: int) -> None:
        self._now += 1
        self._arena.seq[r] = self._now

    def insert(self, eid: int, nbytes: int, nblocks: int, key: int = 0) -> None:
        self.remove(eid)
        nbytes = max(1, int(nbytes))
        was = self._ghosts.pop(key) if key else None
        if was is not None:  # its distance is measured before it is tracked again
            self.ghost_hits += 1
            self._came_back(was, nbytes)
        self._now += 1
        self._arena.add(eid, nbytes, key, self._now, PROBATION if was is None else MAIN)

    def _came_back(self, ghost: tuple[bool, int, int], nbytes: int) -> None:
        """An entry was put again while its ghost ``(main, last use, bytes)`` was
        remembered."""

    def touch(self, eids: Sequence[int], hit_bytes: Sequence[int]) -> None:
        a = self._arena
        for eid in reversed(eids):  # the head ends most recent: tails go first
            r = a.row(eid)
            if r < 0:
                continue
            if int(a.queue[r]) == PROBATION:
                self.promoted += 1
            a.unlink(r)
            a.append(r, MAIN)
            self._use(r)

    def remove(self, eid: int, evicted: bool = False) -> None:
        a = self._arena
        r = a.row(eid)
        if r < 0:
            return
        key, main = int(a.key[r]), int(a.queue[r]) == MAIN
        seq, nbytes = int(a.seq[r]), int(a.nbytes[r])
        a.free(r)
        if not evicted:
            return
        if main:
            self.evicted_read += 1
        else:
            self.evicted_unread += 1
        if key:
            limit = max(64, self._ghosts_per_entry * len(self))
            self._ghosts.add(key, main, limit, seq, nbytes)
            if self.keep_evicted:
                self._evicted.append(key)

    def take_ghosts(self) -> list[int]:
        out, self._evicted = self._evicted, []
        return out

    def promote(self, key: int) -> bool:
        a = self._arena
        r = a.row_of_key(key)
        if r < 0 or int(a.queue[r]) != PROBATION:
            return False
        a.unlink(r)
        a.append(r, MAIN)
        self.cluster_ghost_hits += 1
        return True

    def ghost_returned(self, key: int) -> None:
        was = self._ghosts.pop(key)
        if was is not None:
            self.ghosts_returned += 1
            self._came_back(was, 0)

    def demote(self, eid: int) -> None:
        a = self._arena
        r = a.row(eid)
        if r < 0:
            return
        a.unlink(r)  # to probation's head: the first to go
        a.push_front(r, PROBATION)
        a.seq[r] = 0  # the oldest use: ``aged`` ranks by age
        self.demoted += 1

    def _skip(self, skipped: set[int], evictable: Callable[[int], bool], queue: int) -> int:
        """The oldest evictable row of ``queue`` (-1: none), adding the others to
        ``skipped``."""
        a = self._arena
        for r in a.oldest(queue, skipped):
            eid = int(a.eid[r])
            if evictable(eid):
                return r
            skipped.add(eid)
        return -1

    def victims(self, evictable: Callable[[int], bool]) -> Iterator[int]:
        skipped: set[int] = set()  # not evictable now (leased): asked once per call
        a = self._arena
        while True:
            prob_first = self._prob_bytes > self.share * self.capacity or not a.count[MAIN]
            found = -1
            for queue in (PROBATION, MAIN) if prob_first else (MAIN, PROBATION):
                found = self._skip(skipped, evictable, queue)
                if found >= 0:
                    break
            if found < 0:
                return
            yield int(a.eid[found])

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
        return self._arena.size + self._ghosts.size


# ---------------------------------------------------------------------- adaptive
class AdaptivePolicy(ProbationPolicy):
    """``probation`` whose FIFO share (between ``low`` and ``high``, starting at ``low``)
    follows what one LRU of the same capacity would have done with the pool's own traffic. The
    stack distance of an entry or a ghost is the bytes of every tracked item (entries and
    ghosts) used since it was, so LRU would hold it again iff that is at most the capacity:

    - a ghost evicted from probation put again within the capacity is a hit LRU would have
      had and probation lost: the share grows by the entry's part of the capacity;
    - a read of a main entry from beyond the capacity is a hit LRU would have lost: the
      share shrinks by the bytes read's part.

    A tight cache, where what is reused comes back after more than its capacity of traffic,
    keeps the doorkeeper; a roomy one, where LRU would have held the one-off puts' next use,
    drifts towards recency. Bookkeeping: that of ``probation``."""

    name = "adaptive"

    def __init__(
        self, capacity: int, *, low: float = 0.02, high: float = 0.5, ghosts: int = 4
    ) -> None:
        super().__init__(capacity, share=low, ghosts=ghosts)
        self.low, self.high = low, high
        self.lru_would_hit = 0  # probation's misses LRU would have hit
        self.lru_would_miss = 0  # main's hits LRU would have missed

    def _since(self, seq: int) -> int:
        return self._arena.since(seq) + self._ghosts.since(seq)

    def _came_back(self, ghost: tuple[bool, int, int], nbytes: int) -> None:
        main, seq, ghost_bytes = ghost
        if not main and seq >= 0 and self._since(seq) <= self.capacity:
            self.lru_would_hit += 1
            self._lru_would_hit(nbytes or ghost_bytes)  # 0: its ghost's size

    def _lru_would_hit(self, nbytes: float) -> None:
        """Probation lost ``nbytes`` that LRU would have kept: the FIFO grows."""
        self.share = min(self.high, self.share + nbytes / self.capacity)

    def _lru_would_miss(self, nbytes: float) -> None:
        """Main served ``nbytes`` that LRU would have lost: the FIFO shrinks."""
        self.share = max(self.low, self.share - nbytes / self.capacity)

    def touch(self, eids: Sequence[int], hit_bytes: Sequence[int]) -> None:
        a = self._arena
        for eid, hit in zip(eids, hit_bytes, strict=True):
            r = a.row(eid) if hit else -1
            if r >= 0 and int(a.queue[r]) == MAIN and self._since(int(a.seq[r])) > self.capacity:
                self.lru_would_miss += 1
                self._lru_would_miss(hit)
        super().touch(eids, hit_bytes)

    def stats(self) -> dict[str, int]:
        return {
            **super().stats(),
            "lru_would_hit": self.lru_would_hit,
            "lru_would_miss": self.lru_would_miss,
        }


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
    it). Bookkeeping: that of ``probation``."""

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
        a = self._arena
        while True:
            prob = self._skip(skipped, evictable, PROBATION)
            main = self._skip(skipped, evictable, MAIN)
            if prob < 0 or main < 0:
                found = main if prob < 0 else prob
                if found < 0:
                    return
                yield int(a.eid[found])
                continue
            age_prob = self._now - int(a.seq[prob])
            age_main = self._now - int(a.seq[main])
            yield int(a.eid[prob if age_prob * self.weight >= age_main else main])

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
    together: int = 1,
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
    of at most that many blocks (a pool's ``segment_bytes``), inserted tail first.
    ``together`` > 1 runs requests in groups of that many that do not see each other's puts
    (engines working at once, as the concurrent replay's rounds): a request misses a block an
    earlier one of its group put, and does not put it again."""
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

    fresh: set[int] = set()  # put by an earlier request of the current group: not seen yet
    for i, req in enumerate(requests):
        if together > 1 and i % together == 0:
            fresh.clear()
        n = 0
        for x in req:
            if x not in where or x in fresh:
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
            if together > 1:
                fresh.update(group)
            used[me] += len(group)
            max_used = max(max_used, used[me])
            pol.insert(eid, len(group), len(group), key=group[0] + 2)
            if cluster is not None:
                for slot, key in zip(*cluster.added(me, [group[0] + 2]), strict=True):
                    pols[me].promote(int(key))
                    if slot != me:
                        pols[int(slot)].ghost_returned(int(key))
    return SimResult(hit, total, evicted, max_used)
