"""The engine tier: which vLLM engines hold which blocks in their own KV cache.

Routing data only, never a load source: an engine's cache is not readable by other engines,
so nothing here is consulted by the connector's lookups or loads (they read
:class:`~kvray.meta.view.LocalView`'s location codes, a separate table).

One row per block id (:func:`kvray.meta.ids.engine_ids`) and a 64-bit mask of the replica
slots holding it: a prefix shared by every replica costs one row. Both the index shard
(:class:`EngineHolders`) and each client view (:class:`EngineView`) keep such a table; the
change feed carries ``(ids, masks)`` records, mask 0 meaning "held by no engine any more".

Size: 16 bytes a row (8-byte id, 8-byte mask) at a load of 0.45-0.9 (``max_load`` 0.9, a
growing table doubles): 18-36 bytes per distinct engine block, 27 on average. The stated
budget is :data:`BYTES_PER_ENTRY` = 36: 64 replicas x 200k distinct blocks (12.8M rows, the
worst case: no block shared) fit in 461 MB, and in far less when replicas share prefixes.
"""

from __future__ import annotations

import numpy as np

from kvray.meta.ids import index_shard_of
from kvray.meta.idtable import IdTable

__all__ = [
    "BYTES_PER_ENTRY",
    "ENGINE_TTL_S",
    "MAX_REPLICAS",
    "REPLICA_ENV",
    "REPORT_INTERVAL_S",
    "EngineHolders",
    "EngineView",
    "prefix_by_slot",
]

#: Replica slots (bits of a mask). Engines beyond it report nothing (counted, logged).
MAX_REPLICAS = 64
#: The budget of a view and of an index shard: bytes per distinct engine block, at most.
BYTES_PER_ENTRY = 36
MAX_LOAD = 0.9
#: The Serve replica's unique id, set by kvray's Serve backend for the engine's processes.
REPLICA_ENV = "KVRAY_REPLICA"
#: An engine reports at least this often (an empty report is its heartbeat) ...
REPORT_INTERVAL_S = 0.5
#: ... and an engine silent this long is gone: its entries are purged.
ENGINE_TTL_S = 3.0

_ONE = np.uint64(1)
_EMPTY = np.zeros(0, dtype=np.uint64)


def _bit(slot: int) -> np.uint64:
    if not 0 <= slot < MAX_REPLICAS:
        raise ValueError(f"kvray: replica slot {slot} outside 0..{MAX_REPLICAS - 1}")
    return _ONE << np.uint64(slot)


def _table() -> IdTable:
    return IdTable({"mask": np.uint64}, max_load=MAX_LOAD)


def prefix_by_slot(masks: np.ndarray) -> np.ndarray:
    """For masks of a prompt's blocks in order: per slot (64 counts), how many leading blocks
    that slot's engine holds."""
    if not masks.size:
        return np.zeros(MAX_REPLICAS, dtype=np.int64)
    acc = np.bitwise_and.accumulate(np.asarray(masks, dtype="<u8"))  # a bit, once lost, stays 0
    bits = np.unpackbits(acc.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
    return bits.sum(axis=0, dtype=np.int64)


class EngineHolders:
    """An index shard's engine tier: id -> mask of holding replica slots. Each mutation returns
    the rows whose mask changed, ``(ids, new masks)``, for the change feed."""

    def __init__(self) -> None:
        self.table = _table()

    def __len__(self) -> int:
        return len(self.table)

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def add(self, slot: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.unique(np.asarray(ids, dtype=np.uint64))
        if not ids.size:
            return _EMPTY, _EMPTY
        rows, _ = self.table.claim(ids)
        col = self.table.cols["mask"]
        old = col[rows].copy()
        new = old | _bit(slot)
        col[rows] = new
        changed = new != old
        return ids[changed], new[changed]

    def remove(self, slot: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.unique(np.asarray(ids, dtype=np.uint64))
        rows = self.table.find(ids)
        found = rows >= 0
        return self._clear_bit(slot, ids[found], rows[found])

    def purge(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Slot ``slot`` holds nothing any more (its engine stopped, restarted or is gone)."""
        col = self.table.cols["mask"]
        rows = np.flatnonzero(self.table.occupied() & (col & _bit(slot) != 0))
        return self._clear_bit(slot, self.table.keys[rows].copy(), rows)

    def held_by(self, slot: int) -> np.ndarray:
        col = self.table.cols["mask"]
        rows = np.flatnonzero(self.table.occupied() & (col & _bit(slot) != 0))
        return self.table.keys[rows].copy()

    def replace(self, slot: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slot ``slot`` holds exactly ``ids`` (a full report): only the net change is
        returned."""
        ids = np.unique(np.asarray(ids, dtype=np.uint64))
        gone = np.setdiff1d(self.held_by(slot), ids, assume_unique=True)
        r_ids, r_masks = self.remove(slot, gone)
        a_ids, a_masks = self.add(slot, ids)
        return np.concatenate((r_ids, a_ids)), np.concatenate((r_masks, a_masks))

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        ids, cols = self.table.items()
        return ids, cols["mask"]

    def _clear_bit(
        self, slot: int, ids: np.ndarray, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        if not ids.size:
            return _EMPTY, _EMPTY
        col = self.table.cols["mask"]
        old = col[rows].copy()
        new = old & ~_bit(slot)
        col[rows] = new
        empty = new == 0
        self.table.delete_slots(rows[empty])
        changed = new != old
        return ids[changed], new[changed]


class EngineView:
    """A client's copy of the engine tier, from the change feed (one writer thread, readers on
    any thread: see :class:`~kvray.meta.idtable.IdTable`)."""

    def __init__(self, num_index_shards: int) -> None:
        self.num_index_shards = num_index_shards
        self.table = _table()

    def __len__(self) -> int:
        return len(self.table)

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def apply(self, ids: np.ndarray, masks: np.ndarray) -> None:
        """Records in order (a later record of an id wins); mask 0 removes the row."""
        if not ids.size:
            return
        if ids.size > 1:
            ids, last = np.unique(ids[::-1], return_index=True)
            masks = masks[::-1][last]
        gone = masks == 0
        self.table.delete(ids[gone])
        self.table.upsert(ids[~gone], mask=masks[~gone])

    def load_index_shard(self, index_shard: int, ids: np.ndarray, masks: np.ndarray) -> None:
        """Replace one index shard's id range (built aside, then swapped in)."""
        old_ids, cols = self.table.items()
        if self.num_index_shards > 1:
            keep = index_shard_of(old_ids, self.num_index_shards) != index_shard
            ids = np.concatenate((old_ids[keep], ids))
            masks = np.concatenate((cols["mask"][keep], masks))
        self.table.load(ids, mask=masks)

    def masks(self, ids: np.ndarray) -> np.ndarray:
        """The replica mask of each id (0: no engine holds it, as far as this view knows)."""
        return self.table.get(ids, "mask")[1]

    def prefix_by_slot(self, ids: np.ndarray) -> np.ndarray:
        """Per replica slot, how many leading ``ids`` its engine holds (64 counts)."""
        return prefix_by_slot(self.masks(ids))
