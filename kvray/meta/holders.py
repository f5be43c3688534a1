"""Which pools hold which shards of each block, and where each complete block can be read.

One entry per block (not per TP shard): a block of a TP group (or PP stage set) has ``nshards``
shards, each stored by the rank that computed it in that rank's node's pool. A block becomes
*visible* only once every shard is held somewhere; its **location code** then says where:

- ``0``: not visible (a shard is missing everywhere);
- ``1 .. MAX_POOLS``: every shard is in pool slot ``code - 1`` (the common case: one node);
- ``>= PLACEMENT_BASE``: shards sit in different pools (multi-node TP/PP): the code names an
  interned *placement*, a tuple giving the pool slot of each shard.

Pure numpy, no Ray: the index shard actor drives it, unit tests drive it directly. Each
mutation returns the blocks whose location code changed (the change feed's records).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from kvray.meta.idtable import IdTable

__all__ = [
    "MAX_POOLS",
    "PLACEMENT_BASE",
    "HolderTable",
    "Placements",
    "decode_slots",
    "full_masks",
    "split_positions",
]

#: Pool slots are 0 .. MAX_POOLS - 1.
MAX_POOLS = 4096
PLACEMENT_BASE = MAX_POOLS + 1
MAX_PLACEMENTS = 65536 - PLACEMENT_BASE
#: Most shards a block may have (TP x PP): one bit each in a uint64 mask.
MAX_SHARDS = 64

_NO_SLOT = np.uint16(0xFFFF)
_MULTI = np.uint16(0xFFFE)
_ONE = np.uint64(1)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


def split_positions(locs: np.ndarray) -> np.ndarray:
    """Positions of the location codes that name a placement (blocks split across pools)."""
    return np.flatnonzero(locs >= PLACEMENT_BASE)


def decode_slots(
    locs: np.ndarray, shard: int, placements: Sequence[tuple[int, ...] | None]
) -> np.ndarray:
    """The pool slot holding shard ``shard`` of each block, from its location code: ``code -
    1`` for a block one pool holds whole; for the ``j``-th code naming a placement (see
    :func:`split_positions`), ``placements[j][shard]`` (its tuple, None where the reader does
    not know it); -1 for code 0, an unknown placement or a shard the placement lacks."""
    codes = np.asarray(locs).astype(np.int64)
    out = np.where(codes < PLACEMENT_BASE, codes - 1, -1)  # code 0 -> -1
    split = split_positions(codes)
    if len(placements) != split.size:
        raise ValueError(f"{split.size} placement codes, {len(placements)} placements given")
    for i, t in zip(split.tolist(), placements, strict=True):
        if t is not None and shard < len(t):
            out[i] = t[shard]
    return out


def full_masks(nshards: np.ndarray) -> np.ndarray:
    """The shard mask of a complete block (``nshards`` bits set; 64 -> all ones)."""
    n = nshards.astype(np.uint64)
    small = np.minimum(n, np.uint64(63))
    return np.where(n >= 64, _ALL, (_ONE << small) - _ONE)


class Placements:
    """Interned per-shard pool tuples for blocks split across pools, reference-counted.

    A freed code is reused only after the change log has moved past the point it was freed
    (``reuse_floor``), so no client can read an old record of that code with its new meaning.
    """

    def __init__(self) -> None:
        self.codes: dict[tuple[int, ...], int] = {}
        self.tuples: dict[int, tuple[int, ...]] = {}
        self.refs = np.zeros(MAX_PLACEMENTS, dtype=np.int64)
        self._next = 0
        self._freed: deque[tuple[int, int]] = deque()  # (code, seq when freed)
        self.exhausted = 0

    def intern(self, slots: tuple[int, ...], reuse_floor: int) -> int:
        """The code of ``slots`` (0 when the code space is exhausted: the block stays
        invisible and is counted)."""
        code = self.codes.get(slots)
        if code is not None:
            return code
        while self._freed and self.refs[self._freed[0][0] - PLACEMENT_BASE] > 0:
            self._freed.popleft()  # taken again since it was freed: not free any more
        if self._next < MAX_PLACEMENTS:
            code = PLACEMENT_BASE + self._next
            self._next += 1
        elif self._freed and self._freed[0][1] <= reuse_floor:
            code = self._freed.popleft()[0]
            del self.codes[self.tuples.pop(code)]
        else:
            self.exhausted += 1
            return 0
        self.codes[slots] = code
        self.tuples[code] = slots
        return code

    def count(self, old: np.ndarray, new: np.ndarray, seq: int) -> None:
        """Move references from codes ``old`` to codes ``new`` (placement codes only)."""
        o = old[old >= PLACEMENT_BASE].astype(np.int64) - PLACEMENT_BASE
        n = new[new >= PLACEMENT_BASE].astype(np.int64) - PLACEMENT_BASE
        if not (o.size or n.size):
            return
        np.add.at(self.refs, n, 1)
        np.add.at(self.refs, o, -1)
        for i in np.unique(o).tolist():
            if self.refs[i] == 0 and len(self._freed) < MAX_PLACEMENTS:
                self._freed.append((i + PLACEMENT_BASE, seq))

    def live(self) -> dict[int, tuple[int, ...]]:
        return {c: t for c, t in self.tuples.items() if self.refs[c - PLACEMENT_BASE] > 0}

    def __len__(self) -> int:
        return int(np.count_nonzero(self.refs))


class HolderTable:
    """block id -> holders (pool slot + shard mask) -> location code.

    A block held by one pool keeps its holder inline (``slot``, ``mask`` columns); a block
    held by several pools (copies on two nodes, or shards split across nodes) moves to
    ``multi`` (id -> {slot: mask}), which is rare and bounded by the number of blocks.
    """

    def __init__(self) -> None:
        self.table = IdTable(
            {"nshards": np.uint8, "slot": np.uint16, "mask": np.uint64, "loc": np.uint16}
        )
        self.multi: dict[int, dict[int, int]] = {}
        self.placements = Placements()
        #: The change log position, for placement code reuse (set by the owner).
        self.seq = 0
        self.reuse_floor = 0

    def __len__(self) -> int:
        return len(self.table)

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + 200 * len(self.multi)

    # ------------------------------------------------------------------ reads
    def locs(self, ids: np.ndarray) -> np.ndarray:
        """Location code of each id (0: not visible)."""
        return self.table.get(ids, "loc")[1]

    def whole_copies(self, ids: np.ndarray) -> list[tuple[int, list[int]]]:
        """``(id, slots)`` of each of ``ids`` that two or more pools hold whole, the slots in
        order (readers read the first: :meth:`_multi_loc`)."""
        if not self.multi or not ids.size:
            return []
        rows = self.table.find(ids)
        found = rows >= 0
        cols = self.table.cols
        multi = found.copy()
        multi[found] = cols["slot"][rows[found]] == _MULTI
        out = []
        for bid, row in zip(ids[multi].tolist(), rows[multi].tolist(), strict=True):
            full = int(full_masks(cols["nshards"][row : row + 1])[0])
            whole = sorted(s for s, m in self.multi[int(bid)].items() if m == full)
            if len(whole) > 1:
                out.append((int(bid), whole))
        return out

    def other_holder(self, ids: np.ndarray, failed: np.ndarray) -> np.ndarray:
        """For each of ``ids``, a pool slot other than ``failed[i]`` that holds the block
        whole (the lowest such slot), or -1: where a reader whose pool had evicted its copy
        can read the block instead."""
        out = np.full(ids.size, -1, dtype=np.int64)
        if not ids.size:
            return out
        rows = self.table.find(ids)
        found = np.flatnonzero(rows >= 0)
        cols = self.table.cols
        r = rows[found]
        full = full_masks(cols["nshards"][r])
        slot = cols["slot"][r].astype(np.int64)
        one = (slot < MAX_POOLS) & (cols["mask"][r] == full) & (slot != failed[found])
        out[found[one]] = slot[one]
        for j in np.flatnonzero(slot == int(_MULTI)).tolist():
            held = self.multi.get(int(ids[found[j]]), {})
            whole = [s for s, m in held.items() if m == int(full[j]) and s != int(failed[found[j]])]
            if whole:
                out[found[j]] = min(whole)
        return out

    def visible(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, codes) of every visible block."""
        ids, cols = self.table.items()
        loc = cols["loc"]
        keep = loc != 0
        return ids[keep], loc[keep]

    # ------------------------------------------------------------------ mutations
    def add(
        self,
        slot: int,
        ids: np.ndarray,
        shards: np.ndarray,
        nshards: np.ndarray,
        unique: bool = False,
    ) -> Diff:
        """Pool ``slot`` now holds these shards (``unique``: no id repeats in the batch).
        Returns the blocks whose code changed."""
        return _changed(*self._add(slot, ids, shards, nshards, unique))

    def remove(self, slot: int, ids: np.ndarray, shards: np.ndarray) -> Diff:
        """Pool ``slot`` no longer holds these shards."""
        return _changed(*self._remove(slot, ids, shards))

    def purge(self, slot: int) -> Diff:
        """Pool ``slot`` holds nothing any more (it died or stopped answering)."""
        return _changed(*self._purge(slot))

    def replace(self, slot: int, ids: np.ndarray, shards: np.ndarray, nshards: np.ndarray) -> Diff:
        """Pool ``slot`` holds exactly these shards (a resync from its inventory): only the
        net change is reported, so a resync of an unchanged pool emits nothing."""
        t1, o1, _ = self._purge(slot)
        t2, o2, _ = self._add(slot, ids, shards, nshards, False)
        touched = np.concatenate((t1, t2))
        old = np.concatenate((o1, o2))
        touched, first = np.unique(touched, return_index=True)
        return _changed(touched, old[first], self.locs(touched))

    # ------------------------------------------------------------------ internals
    def _add(
        self, slot: int, ids: np.ndarray, shards: np.ndarray, nshards: np.ndarray, unique: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not ids.size:
            return _EMPTY_IDS, _EMPTY_LOCS, _EMPTY_LOCS
        if unique:
            uniq, bits = np.asarray(ids, dtype=np.uint64), _bits(shards)
            nsh = np.asarray(nshards, dtype=np.uint8)
        else:
            uniq, bits, first = _group(ids, shards)
            nsh = np.asarray(nshards, dtype=np.uint8)[first]
        slots, new = self.table.claim(uniq)
        cols = self.table.cols
        sl, mk = cols["slot"], cols["mask"]
        if new.all():  # the common case: blocks this index has not seen (columns are zero)
            cols["nshards"][slots] = nsh
            sl[slots] = slot
            mk[slots] = bits
            loc = np.where(bits == full_masks(nsh), np.uint16(slot + 1), np.uint16(0))
            cols["loc"][slots] = loc
            return uniq, np.zeros(uniq.size, dtype=np.uint16), loc
        old = cols["loc"][slots].copy()
        s_new = slots[new]
        cols["nshards"][s_new] = nsh[new]
        sl[s_new] = slot
        mk[s_new] = bits[new]
        ex = np.flatnonzero(~new)
        s_ex = slots[ex]
        same = sl[s_ex] == slot
        mk[s_ex[same]] |= bits[ex[same]]
        for i in ex[~same].tolist():  # a second pool, or an already split block: rare
            self._add_multi(int(uniq[i]), int(slots[i]), slot, int(bits[i]))
        return uniq, old, self._relocate(slots, uniq, old)

    def _add_multi(self, bid: int, row: int, slot: int, bits: int) -> None:
        cols = self.table.cols
        holders = self.multi.get(bid)
        if holders is None:
            prev = int(cols["slot"][row])
            holders = self.multi[bid] = {} if prev == _NO_SLOT else {prev: int(cols["mask"][row])}
            cols["slot"][row] = _MULTI
            cols["mask"][row] = 0
        holders[slot] = holders.get(slot, 0) | bits

    def _remove(
        self, slot: int, ids: np.ndarray, shards: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not ids.size:
            return _EMPTY_IDS, _EMPTY_LOCS, _EMPTY_LOCS
        uniq, bits, _ = _group(ids, shards)
        slots = self.table.find(uniq)
        keep = slots >= 0
        uniq, bits, slots = uniq[keep], bits[keep], slots[keep]
        cols = self.table.cols
        old = cols["loc"][slots].copy()
        sl, mk = cols["slot"], cols["mask"]
        cur = sl[slots]
        same = cur == slot
        mk[slots[same]] &= ~bits[same]
        for i in np.flatnonzero(cur == _MULTI).tolist():
            self._remove_multi(int(uniq[i]), int(slots[i]), slot, int(bits[i]))
        return uniq, old, self._relocate(slots, uniq, old)

    def _remove_multi(self, bid: int, row: int, slot: int, bits: int) -> None:
        holders = self.multi[bid]
        if slot not in holders:
            return
        left = holders[slot] & ~bits
        if left:
            holders[slot] = left
        else:
            del holders[slot]
        if len(holders) <= 1:  # back inline
            del self.multi[bid]
            cols = self.table.cols
            (s, m), *_ = holders.items() if holders else ((int(_NO_SLOT), 0),)
            cols["slot"][row] = s
            cols["mask"][row] = m

    def _purge(self, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cols = self.table.cols
        rows = np.flatnonzero(self.table.occupied() & (cols["slot"] == slot))
        cols["mask"][rows] = 0
        multi_ids = [bid for bid, h in self.multi.items() if slot in h]
        if multi_ids:
            mids = np.array(multi_ids, dtype=np.uint64)
            mrows = self.table.find(mids)
            for bid, row in zip(multi_ids, mrows.tolist(), strict=True):
                self._remove_multi(bid, row, slot, int(_ALL))
            rows = np.concatenate((rows, mrows))
        ids = self.table.keys[rows].copy()
        old = cols["loc"][rows].copy()
        return ids, old, self._relocate(rows, ids, old)

    def _relocate(self, rows: np.ndarray, ids: np.ndarray, old: np.ndarray) -> np.ndarray:
        """Recompute the code of ``rows`` after their holders changed; drop empty rows.
        Returns the new codes (0 for dropped rows)."""
        cols = self.table.cols
        sl, mk = cols["slot"], cols["mask"]
        slot = sl[rows]
        mask = mk[rows]
        full = full_masks(cols["nshards"][rows])
        loc = np.where((slot < MAX_POOLS) & (mask == full), slot.astype(np.uint16) + 1, 0)
        loc = loc.astype(np.uint16)
        for i in np.flatnonzero(slot == _MULTI).tolist():
            loc[i] = self._multi_loc(int(ids[i]), int(full[i]), int(cols["nshards"][rows[i]]))
        self.placements.count(old, loc, self.seq)
        cols["loc"][rows] = loc
        dead = (slot != _MULTI) & (mask == 0)
        if dead.any():
            self.table.delete_slots(rows[dead])
        return loc

    def _multi_loc(self, bid: int, full: int, nshards: int) -> int:
        holders = self.multi[bid]
        whole = [s for s, m in holders.items() if m == full]
        if whole:
            return min(whole) + 1
        union = 0
        for m in holders.values():
            union |= m
        if union != full:
            return 0
        order = sorted(holders)
        per_shard = tuple(next(s for s in order if holders[s] >> i & 1) for i in range(nshards))
        return self.placements.intern(per_shard, self.reuse_floor)


class Diff:
    """Blocks whose location code changed, and the new codes (0: no longer visible)."""

    __slots__ = ("ids", "locs")

    def __init__(self, ids: np.ndarray, locs: np.ndarray) -> None:
        self.ids = ids
        self.locs = locs

    def __len__(self) -> int:
        return int(self.ids.size)


_EMPTY_IDS = np.zeros(0, dtype=np.uint64)
_EMPTY_LOCS = np.zeros(0, dtype=np.uint16)


def _changed(ids: np.ndarray, old: np.ndarray, new: np.ndarray) -> Diff:
    keep = new != old
    return Diff(ids[keep], new[keep])


def _bits(shards: np.ndarray) -> np.ndarray:
    sh = np.asarray(shards, dtype=np.uint64)
    if sh.size and int(sh.max()) >= MAX_SHARDS:
        raise ValueError(f"kvray: a block has at most {MAX_SHARDS} shards, got shard {sh.max()}")
    return _ONE << sh


def _group(ids: np.ndarray, shards: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unique ids, the OR of their shard bits, and the index of each id's first occurrence."""
    ids = np.asarray(ids, dtype=np.uint64)
    bits = _bits(shards)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    start = np.flatnonzero(np.concatenate(([True], sorted_ids[1:] != sorted_ids[:-1])))
    return sorted_ids[start], np.bitwise_or.reduceat(bits[order], start), order[start]
