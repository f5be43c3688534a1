"""An open-addressing hash table of 64-bit ids with numpy value columns, used in batches.

Why not a dict: a Python dict of ``bytes`` keys costs 100-200 bytes a key and one interpreter
step per key; this table costs ``(8 + value bytes) / load`` (12-30 bytes a block for a view),
and its probe and insert loops are compiled (:mod:`kvray.meta.idloops`): a 64-id prefix lookup
in a table of 10M ids takes a few microseconds, a batch insert tens of nanoseconds an id.

Layout: ``keys`` holds the ids (``0`` empty, ``1`` deleted), each value column is an array of
the same length, linear probing from a Fibonacci-hashed home slot. Deleted slots become
tombstones (never reused before a rebuild, so an empty slot always has zero columns); the table
is rebuilt, doubling when it must, when live ids and tombstones pass the load limit.

Concurrency: one writer thread, any number of readers. A rebuild swaps one state object, so a
reader sees the old or the new arrays, never a mix; a reader racing an insert may miss the id
or see it with its columns still zero (callers treat zero values as "not there yet").
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from kvray.meta.ids import TOMB

__all__ = ["IdTable", "warm_up"]

_MIN_CAPACITY = 64
#: :mod:`kvray.meta.idloops`' multiplier (Fibonacci hashing), for :meth:`IdTable.find_one`.
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


@functools.cache
def _k() -> ModuleType:
    """:mod:`kvray.meta.idloops`, imported (and numba with it) on first use."""
    from kvray.meta import idloops as kernels

    return kernels


@functools.cache
def warm_up() -> None:
    """Import numba and load (or compile) every kernel now, once per process.

    The first table operation otherwise pays it: importing numba and loading the cached
    machine code took 1-5 s of a vLLM scheduler's first lookup on the 2-core box (the first
    request's TTFT), and a compile on a fresh machine takes longer. Processes that answer
    lookups call this when they subscribe, before they serve."""
    t = IdTable({"v": np.uint16})
    ids = np.arange(2, 10, dtype=np.uint64)
    t.upsert(ids, v=1)
    t.find(ids)
    t.prefix_len(ids)
    t.items()
    t.delete(ids[:2])


@dataclass(frozen=True, eq=False)
class _State:
    keys: np.ndarray
    cols: dict[str, np.ndarray]
    shift: np.uint64  # 64 - log2(capacity)


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
        return _State(keys, cols, np.uint64(65 - cap.bit_length()))

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
        live = _k().live_slots(old.keys)
        new = self._build(cap, old.keys[live], {n: c[live] for n, c in old.cols.items()})
        self._s = new  # readers switch here, never see a half-built table
        self._live = self._used = int(live.size)

    def _build(self, cap: int, ids: np.ndarray, values: Mapping[str, np.ndarray]) -> _State:
        new = self._new_state(cap)
        if ids.size:
            slots = np.empty(ids.size, dtype=np.int64)
            _k().claim(new.keys, new.shift, ids, slots, np.empty(ids.size, dtype=np.bool_))
            for name, col in new.cols.items():
                if name in values:
                    col[slots] = values[name]
        return new

    def clear(self) -> None:
        self._s = self._new_state(_MIN_CAPACITY)
        self._live = self._used = 0

    def load(self, ids: np.ndarray, **values: np.ndarray) -> None:
        """Replace the whole content with unique ``ids`` (built aside, then swapped in)."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        self._s = self._build(_capacity_for(ids.size, self.max_load), ids, values)
        self._live = self._used = int(ids.size)

    # ------------------------------------------------------------------ queries
    def find(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, or -1 where absent."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        out = np.empty(ids.size, dtype=np.int64)
        s = self._s
        _k().find(s.keys, s.shift, ids, out)
        return out

    def find_one(self, x: int) -> int:
        """Slot of one id, or -1: the probe of :meth:`find` in Python, ~5x faster for one
        id than an array call (a policy's per-entry lookups)."""
        s = self._s
        keys = s.keys
        mask = keys.size - 1
        p = ((x * _GOLDEN) & _MASK64) >> int(s.shift)
        while True:
            k = int(keys[p])
            if k == x:
                return p
            if k == 0:
                return -1
            p = (p + 1) & mask

    def contains(self, ids: np.ndarray) -> np.ndarray:
        return self.find(ids) >= 0

    def get(self, ids: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(found, values of column ``name``; 0 where not found)."""
        s = self._s
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        slots = np.empty(ids.size, dtype=np.int64)
        _k().find(s.keys, s.shift, ids, slots)
        found = slots >= 0
        col = s.cols[name]
        vals = np.zeros(slots.size, dtype=col.dtype)
        vals[found] = col[slots[found]]
        return found, vals

    def prefix_len(self, ids: np.ndarray) -> int:
        """Length of the longest prefix of ``ids`` that is present."""
        s = self._s
        return int(_k().prefix_len(s.keys, s.shift, np.ascontiguousarray(ids, dtype=np.uint64)))

    def items(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Every live id and its values (copies)."""
        s = self._s
        live = _k().live_slots(s.keys)
        return s.keys[live], {name: c[live] for name, c in s.cols.items()}

    def occupied(self) -> np.ndarray:
        """Boolean mask of live slots (for column scans)."""
        return self._s.keys > TOMB

    # ------------------------------------------------------------------ updates
    def claim(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slots of unique ``ids``, inserting the absent ones (their columns zero); returns
        (slots, is_new). Read ``cols`` after the call: it may have rebuilt the table."""
        return self.upsert(ids)

    def upsert(self, ids: np.ndarray, **values: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """Insert or overwrite unique ``ids`` with column ``values``; returns (slots, is_new).
        Columns not given are zero for new ids and kept for existing ones."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        if not ids.size:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
        if ids.min() <= TOMB:
            raise ValueError("IdTable: ids 0 and 1 are reserved")
        self._reserve(ids.size)
        s = self._s
        slots = np.empty(ids.size, dtype=np.int64)
        new = np.empty(ids.size, dtype=np.bool_)
        n_new = int(_k().claim(s.keys, s.shift, ids, slots, new))
        self._live += n_new
        self._used += n_new
        for name, value in values.items():
            s.cols[name][slots] = value
        return slots, new

    def upsert_one(self, x: int, **values: int) -> int:
        """:meth:`upsert` of one id, probed in Python (a policy's per-entry inserts); its
        slot."""
        if x <= TOMB:
            raise ValueError("IdTable: ids 0 and 1 are reserved")
        slot = self.find_one(x)
        if slot < 0:
            self._reserve(1)
            s = self._s
            keys = s.keys
            mask = keys.size - 1
            p = ((x * _GOLDEN) & _MASK64) >> int(s.shift)
            while int(keys[p]) != 0:  # tombstones are not reused before a rebuild
                p = (p + 1) & mask
            keys[p] = x
            self._live += 1
            self._used += 1
            slot = p
        cols = self._s.cols
        for name, value in values.items():
            cols[name][slot] = value
        return slot

    def delete_one(self, x: int) -> bool:
        """:meth:`delete` of one id; whether it was present."""
        slot = self.find_one(x)
        if slot < 0:
            return False
        self._s.keys[slot] = TOMB
        self._live -= 1
        if self._live == 0:
            self.clear()
        return True

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
