"""A process's local copy of the index: visible block id -> location code, pools, placements.

Applied from the change feeds of every index shard (:mod:`kvray.feed`) and read by lookups on
other threads with no lock: one writer, many readers (see :class:`~kvray.meta.idtable.IdTable`).
A snapshot is built aside and swapped in, so a lookup never sees a half-loaded view.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from kvray.meta.engine_table import EngineView
from kvray.meta.holders import decode_slots, split_positions
from kvray.meta.ids import index_shard_of
from kvray.meta.idtable import IdTable
from kvray.meta.messages import Changes, NodeInfo, ReplicaInfo

__all__ = ["LocalView"]

_V = TypeVar("_V")

#: Called with (ids that became visible, ids that stopped being visible) after each apply.
Listener = Callable[[np.ndarray, np.ndarray], None]


class LocalView:
    """Visible blocks of a namespace as seen by this process."""

    def __init__(self, num_index_shards: int) -> None:
        self.num_index_shards = num_index_shards
        self.table = IdTable({"loc": np.uint16})
        self.epochs = [""] * num_index_shards
        self.seqs = [-1] * num_index_shards
        self.placements: list[dict[int, tuple[int, ...]]] = [{} for _ in range(num_index_shards)]
        self._nodes_of: list[dict[int, NodeInfo]] = [{} for _ in range(num_index_shards)]
        #: slot -> pool, merged over the shards' tables.
        self.nodes: dict[int, NodeInfo] = {}
        self.listener: Listener | None = None
        #: The engine tier (routing only, never a load source: lookups above never read it).
        self.engine = EngineView(num_index_shards)
        self._replicas_of: list[dict[int, ReplicaInfo]] = [{} for _ in range(num_index_shards)]
        #: slot -> reporting engine, merged over the shards.
        self.replicas: dict[int, ReplicaInfo] = {}

    def __len__(self) -> int:
        return len(self.table)

    @property
    def nbytes(self) -> int:
        """Memory of the view: the CPU tier's table and the engine tier's."""
        return self.table.nbytes + self.engine.nbytes

    # ------------------------------------------------------------------ writes (feed thread)
    def apply(self, ch: Changes) -> None:
        s = ch.index_shard
        if ch.snapshot:
            self._load_index_shard(s, ch.ids, ch.locs)
            self.placements[s] = dict(ch.placements)
            self.engine.load_index_shard(s, ch.engine_ids, ch.engine_masks)
        else:
            self.placements[s].update(ch.placements)
            self._apply_records(ch.ids, ch.locs)
            self.engine.apply(ch.engine_ids, ch.engine_masks)
        self._nodes_of[s] = ch.nodes
        self.nodes = _merge(self._nodes_of)
        self._replicas_of[s] = ch.replicas
        self.replicas = _merge(self._replicas_of)
        self.epochs[s], self.seqs[s] = ch.epoch, ch.seq

    def load(self, snapshots: list[Changes]) -> None:
        """Start from a snapshot of every shard at once (one table build, not one per shard)."""
        if sorted(ch.index_shard for ch in snapshots) != list(range(self.num_index_shards)):
            raise ValueError("LocalView.load needs one snapshot of every shard")
        if not all(ch.snapshot for ch in snapshots):
            raise ValueError("LocalView.load takes snapshots only")
        self.table.load(
            np.concatenate([ch.ids for ch in snapshots]),
            loc=np.concatenate([ch.locs for ch in snapshots]),
        )
        self.engine.table.load(
            np.concatenate([ch.engine_ids for ch in snapshots]),
            mask=np.concatenate([ch.engine_masks for ch in snapshots]),
        )
        for ch in snapshots:
            self._replicas_of[ch.index_shard] = ch.replicas
            self.placements[ch.index_shard] = dict(ch.placements)
            self._nodes_of[ch.index_shard] = ch.nodes
            self.epochs[ch.index_shard], self.seqs[ch.index_shard] = ch.epoch, ch.seq
        self.nodes = _merge(self._nodes_of)
        self.replicas = _merge(self._replicas_of)

    def _apply_records(self, ids: np.ndarray, locs: np.ndarray) -> None:
        if not ids.size:
            return
        if ids.size > 1:  # a later record of an id wins
            rev_ids = ids[::-1]
            ids, last = np.unique(rev_ids, return_index=True)
            locs = locs[::-1][last]
        gone = locs == 0
        if self.listener is not None:
            present = self.table.contains(ids)
            added, removed = ids[~gone & ~present], ids[gone & present]
        self.table.delete(ids[gone])
        self.table.upsert(ids[~gone], loc=locs[~gone])
        if self.listener is not None:
            self.listener(added, removed)

    def _load_index_shard(self, index_shard: int, ids: np.ndarray, locs: np.ndarray) -> None:
        """Replace everything of one index shard's id range (built aside, then swapped in)."""
        old_ids, cols = self.table.items()
        if self.num_index_shards > 1:
            keep = index_shard_of(old_ids, self.num_index_shards) != index_shard
            all_ids = np.concatenate((old_ids[keep], ids))
            all_locs = np.concatenate((cols["loc"][keep], locs))
            old_ids = old_ids[~keep]
        else:
            all_ids, all_locs = ids, locs
        self.table.load(all_ids, loc=all_locs)
        if self.listener is not None:
            self.listener(np.setdiff1d(ids, old_ids), np.setdiff1d(old_ids, ids))

    def clear_index_shard(self, index_shard: int) -> None:
        """Forget one index shard (its index is gone): no lookup reports its blocks any more."""
        self._load_index_shard(
            index_shard, np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint16)
        )
        self.placements[index_shard] = {}
        self._nodes_of[index_shard] = {}
        self.nodes = _merge(self._nodes_of)
        self.engine.load_index_shard(
            index_shard, np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)
        )
        self._replicas_of[index_shard] = {}
        self.replicas = _merge(self._replicas_of)
        self.epochs[index_shard], self.seqs[index_shard] = "", -1

    # ------------------------------------------------------------------ reads (any thread)
    def lookup(self, ids: np.ndarray) -> int:
        """Length of the longest prefix of ``ids`` visible in the view."""
        return self.table.prefix_len(ids)

    def contains(self, ids: np.ndarray) -> np.ndarray:
        return self.table.contains(ids)

    def engine_prefix(self, ids: np.ndarray) -> dict[str, tuple[int, float]]:
        """Per reporting engine (its key): how many leading blocks of ``ids`` (engine ids) its
        own cache holds, and its KV usage (the engine tier: for routing, never a load)."""
        counts = self.engine.prefix_by_slot(ids)
        return {info.key: (int(counts[slot]), info.usage) for slot, info in self.replicas.items()}

    def engine_costs(self) -> dict[str, tuple[float, ...]]:
        """Per reporting engine (its key): its published cost estimates
        (:class:`~kvray.meta.costs.Costs` on the wire; empty: none yet)."""
        return {info.key: info.costs for info in self.replicas.values()}

    def locs(self, ids: np.ndarray) -> np.ndarray:
        """Location code of each id (0: not visible, or not yet)."""
        return self.table.get(ids, "loc")[1]

    def slot_of(self, ids: np.ndarray, locs: np.ndarray, shard: int) -> np.ndarray:
        """The pool slot holding shard ``shard`` of each block (-1: unknown)."""
        split = split_positions(locs)
        return decode_slots(locs, shard, self.placements_of(ids[split], locs[split]))

    def placements_of(self, ids: np.ndarray, codes: np.ndarray) -> list[tuple[int, ...] | None]:
        """The pool slot of each shard for blocks ``ids`` at placement codes ``codes`` (None:
        not known here). Codes are interned per index shard: each block's owner resolves it."""
        if not ids.size:
            return []
        owner = index_shard_of(ids, self.num_index_shards).tolist()
        return [self.placements[o].get(c) for o, c in zip(owner, codes.tolist(), strict=True)]

    def pool_names(self) -> dict[int, str]:
        return {slot: n.pool_name for slot, n in self.nodes.items()}


def _merge(tables: list[dict[int, _V]]) -> dict[int, _V]:
    out: dict[int, _V] = {}
    for t in tables:
        out.update(t)
    return out
