"""An open-addressing hash table of 64-bit ids with numpy value columns, used in batches.

Why not a dict: a Python dict of ``bytes`` keys costs 100-200 bytes a key and one interpreter
step per key; this table costs ``(8 + value bytes) / load`` (12-30 bytes a block for a view)
and answers a batch of ids with a handful of numpy calls.

Layout: ``keys`` holds the ids (``0`` empty, ``1`` deleted), each value column is an array of
the same length. Linear probing: a batch is probed in rounds, each round one vectorized step
for every id not yet settled (at the load factors kept here, <= 0.75, most ids settle in the
first round and the rounds shrink fast). Short batches (a prompt's lookup) read all home slots
in one gather and probe on in a loop over Python ints, which beats the fixed cost of a dozen
numpy calls. Deleted slots become tombstones; the table is rebuilt when tombstones and live ids
pass the load limit.

Concurrency: one writer thread, any number of readers. A rebuild swaps one state object, so a
reader sees the old or the new arrays, never a mix; a reader racing an insert may miss the id
or see it with its columns still zero (callers treat zero values as "not there yet").

The home slot of an id is the top bits of ``id * 0x9E3779B97F4A7C15`` (Fibonacci hashing), so
even sequential ids spread over the table instead of forming one long probe run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kvray.meta.ids import EMPTY, TOMB

__all__ = ["IdTable"]

#: Lookups of up to this many ids take the gather-then-loop path.
SMALL = 192
_MIN_CAPACITY = 64


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True, eq=False)
class _State:
    keys: np.ndarray
    cols: dict[str, np.ndarray]
    mask: int
    view: memoryview
    shift: np.uint64  # 64 - log2(capacity)

    def home(self, ids: np.ndarray) -> np.ndarray:
        return (np.multiply(ids, _GOLDEN) >> self.shift).astype(np.int64)


class IdTable:
    """``id -> values`` for uint64 ids (never 0 or 1), with any number of numpy value columns.

    Every method takes and returns arrays; ids within one call must be unique for ``claim``
    and ``upsert`` (callers dedupe with ``np.unique``).
    """

    def __init__(
        self,
        columns: Mapping[str, np.dtype | type] | None = None,
        capacity: int = 0,
        max_load: float = 0.75,
    ) -> None:
        if not 0.1 <= max_load <= 0.9:
            raise ValueError(f"IdTable: max_load must be in [0.1, 0.9], got {max_load}")
        self._dtypes = {name: np.dtype(dt) for name, dt in (columns or {}).items()}
        self.max_load = max_load
        self._live = 0
        self._used = 0  # live + tombstones
        self._s = self._new_state(_capacity_for(capacity, max_load))

    # ------------------------------------------------------------------ storage
    def _new_state(self, cap: int) -> _State:
        keys = np.zeros(cap, dtype=np.uint64)
        cols = {name: np.zeros(cap, dtype=dt) for name, dt in self._dtypes.items()}
        return _State(keys, cols, cap - 1, memoryview(keys), np.uint64(64 - cap.bit_length() + 1))

    @property
    def keys(self) -> np.ndarray:
        return self._s.keys

    @property
    def cols(self) -> dict[str, np.ndarray]:
        return self._s.cols

    @property
    def capacity(self) -> int:
        return int(self._s.keys.size)

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        """Bytes of the table's arrays."""
        s = self._s
        return int(s.keys.nbytes + sum(c.nbytes for c in s.cols.values()))

    def _reserve(self, extra: int) -> None:
        """Make room for ``extra`` more ids (grow, or rebuild away the tombstones)."""
        if self._used + extra <= self.capacity * self.max_load:
            return
        # The smallest power of two under the load limit: a growing table doubles.
        self._rebuild(_capacity_for(self._live + extra, self.max_load))

    def _rebuild(self, cap: int) -> None:
        old = self._s
        live = old.keys > TOMB
        ids = old.keys[live]
        new = self._new_state(cap)
        if ids.size:
            slots, _ = _claim(new, ids)
            for name, col in new.cols.items():
                col[slots] = old.cols[name][live]
        self._s = new  # readers switch here, never see a half-built table
        self._live = self._used = int(ids.size)

    def clear(self) -> None:
        self._s = self._new_state(_MIN_CAPACITY)
        self._live = self._used = 0

    def load(self, ids: np.ndarray, **values: np.ndarray) -> None:
        """Replace the whole content with unique ``ids`` (built aside, then swapped in)."""
        ids = np.asarray(ids, dtype=np.uint64)
        new = self._new_state(_capacity_for(ids.size, self.max_load))
        if ids.size:
            slots, _ = _claim(new, ids)
            for name, col in new.cols.items():
                if name in values:
                    col[slots] = values[name]
        self._s = new
        self._live = self._used = int(ids.size)

    # ------------------------------------------------------------------ queries
    def find(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, or -1 where absent."""
        ids = np.asarray(ids, dtype=np.uint64)
        return _find(self._s, ids) if self._live else np.full(ids.size, -1, dtype=np.int64)

    def contains(self, ids: np.ndarray) -> np.ndarray:
        return self.find(ids) >= 0

    def get(self, ids: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(found, values of column ``name``; 0 where not found)."""
        s = self._s
        ids = np.asarray(ids, dtype=np.uint64)
        slots = _find(s, ids) if self._live else np.full(ids.size, -1, dtype=np.int64)
        found = slots >= 0
        col = s.cols[name]
        vals = np.zeros(slots.size, dtype=col.dtype)
        vals[found] = col[slots[found]]
        return found, vals

    def prefix_len(self, ids: np.ndarray) -> int:
        """Length of the longest prefix of ``ids`` that is present."""
        ids = np.asarray(ids, dtype=np.uint64)
        if not self._live or not ids.size:
            return 0
        s = self._s
        if ids.size <= SMALL:
            return _prefix_len_small(s, ids)
        found = _find(s, ids) >= 0
        return int(found.size if found.all() else found.argmin())

    def items(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Every live id and its values (copies)."""
        s = self._s
        live = s.keys > TOMB
        return s.keys[live], {name: c[live] for name, c in s.cols.items()}

    def occupied(self) -> np.ndarray:
        """Boolean mask of live slots (for column scans)."""
        return self._s.keys > TOMB

    # ------------------------------------------------------------------ updates
    def claim(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slots of unique ``ids``, inserting the absent ones (their columns zeroed); returns
        (slots, is_new). Read ``cols`` after the call: it may have rebuilt the table."""
        return self.upsert(ids)

    def upsert(self, ids: np.ndarray, **values: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """Insert or overwrite unique ``ids`` with column ``values``; returns (slots, is_new).
        Columns not given are zero for new ids and kept for existing ones."""
        ids = np.asarray(ids, dtype=np.uint64)
        if not ids.size:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
        if ids.min() <= TOMB:
            raise ValueError("IdTable: ids 0 and 1 are reserved")
        self._reserve(ids.size)
        s = self._s
        slots, new = _claim(s, ids)
        n_new = int(new.sum())
        self._live += n_new
        self._used += n_new
        # Empty slots hold zero columns (tombstones are never reused before a rebuild), so a
        # new id's columns start at zero without writing them.
        for name, value in values.items():
            s.cols[name][slots] = value
        return slots, new

    def delete(self, ids: np.ndarray) -> np.ndarray:
        """Remove ids; returns which were present."""
        slots = self.find(ids)
        found = slots >= 0
        self.delete_slots(slots[found])
        return found

    def delete_slots(self, slots: np.ndarray) -> None:
        """Remove the ids in ``slots`` (live slots, unique)."""
        if not slots.size:
            return
        self._s.keys[slots] = TOMB
        self._live -= int(slots.size)
        if self._live == 0:
            self.clear()


def _capacity_for(n: int, max_load: float) -> int:
    cap = _MIN_CAPACITY
    while cap * max_load < n:
        cap <<= 1
    return cap


def _find(s: _State, ids: np.ndarray) -> np.ndarray:
    keys, mask = s.keys, s.mask
    out = np.full(ids.size, -1, dtype=np.int64)
    idx = np.arange(ids.size)
    cur = ids
    pos = s.home(cur)
    while idx.size:
        k = keys[pos]
        hit = k == cur
        out[idx[hit]] = pos[hit]
        # Absent at the first empty slot: inserts fill the first empty one of the chain.
        more = ~hit & (k != EMPTY)
        idx, cur, pos = idx[more], cur[more], (pos[more] + 1) & mask
    return out


def _prefix_len_small(s: _State, ids: np.ndarray) -> int:
    """The home slots of all ids are read in one gather, so the CPU overlaps their cache misses
    (a 64-id lookup in a 10M-id table touches 64 random cache lines); only the ids not found at
    home are probed on, in a loop over Python ints (their next slots are adjacent)."""
    mask = s.mask
    home = s.home(ids)
    first = s.keys[home]
    off = np.flatnonzero(first != ids)
    if not off.size:
        return int(ids.size)
    keys = s.view
    wanted, slots, seen = ids.tolist(), home.tolist(), first.tolist()
    for i in off.tolist():
        x, k, p = wanted[i], seen[i], slots[i]
        while k != x:
            if k == 0:
                return i
            p = (p + 1) & mask
            k = keys[p]
    return int(ids.size)


def _claim(s: _State, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Slots for unique ``ids``: the existing one, else a fresh empty one (its key is written
    here; values are the caller's). Returns (slots, is_new). The caller reserved room."""
    keys, mask = s.keys, s.mask
    slots = np.full(ids.size, -1, dtype=np.int64)
    new = np.zeros(ids.size, dtype=bool)
    idx = np.arange(ids.size)
    cur = ids
    pos = s.home(cur)
    while idx.size:
        k = keys[pos]
        hit = k == cur
        slots[idx[hit]] = pos[hit]
        more = ~hit
        empty = k == EMPTY
        if empty.any():
            # Several ids may race for one empty slot: write them all, keep whichever write
            # landed, and let the others probe on.
            e_pos, e_ids = pos[empty], cur[empty]
            keys[e_pos] = e_ids
            won = keys[e_pos] == e_ids
            e_idx = idx[empty]
            slots[e_idx[won]] = e_pos[won]
            new[e_idx[won]] = True
            more[np.flatnonzero(empty)[won]] = False
        # Everyone left steps on (the slot of a lost race is taken now).
        idx, cur, pos = idx[more], cur[more], (pos[more] + 1) & mask
    return slots, new
