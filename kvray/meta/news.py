"""What an index shard tells each pool about the cluster as one cache (issue 35), Ray-free.

Two kinds of news answer a pool's change batch (:class:`~kvray.meta.messages.GhostNotice`):

- **Ghosts** (:class:`~kvray.meta.ghosts.ClusterGhosts`): a segment put again while the
  cluster remembers its eviction skips probation where it is put, and the pool that evicted
  it gets the evidence.
- **Copies.** Engines that miss the same prefix at once (each looked it up before the
  other's put was visible) put it in two pools. Readers read one copy (the lowest slot:
  :meth:`~kvray.meta.holders.HolderTable.whole_copies`); every other copy is never read,
  and under LRU it sits a whole cache lifetime on capacity the cluster is short of. So a
  copy readers do not see is *demoted* (its pool evicts it first), and the copy they see is
  *reused* (a read: the second put was a miss of it), or promoted if it is the new one.

A pool's news for another pool waits until that pool's next batch is answered (at most
``max_pending`` ids of each kind a pool; older ones are dropped: they are hints). A shard
that restarts forgets them.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kvray.meta.ghosts import ClusterGhosts
from kvray.meta.holders import HolderTable
from kvray.meta.messages import GhostNotice

__all__ = ["MAX_PENDING", "ClusterNews"]

#: News kept for one pool until its next batch takes them, at most (per kind).
MAX_PENDING = 4096

_KINDS = ("returned", "demote", "reused")


class ClusterNews:
    """The cluster's ghosts and copies, as one index shard sees them. Not thread-safe."""

    def __init__(self, *, max_pending: int = MAX_PENDING) -> None:
        self.ghosts = ClusterGhosts()
        self._max = max_pending
        self._pending: dict[int, dict[str, deque[int]]] = {}
        self.duplicates = 0  # segments put while another pool held their first block whole

    def _tell(self, slot: int, kind: str, ids: list[int]) -> None:
        if not ids:
            return
        waiting = self._pending.setdefault(slot, {})
        waiting.setdefault(kind, deque(maxlen=self._max)).extend(ids)

    def batch(
        self, slot: int, evicted: np.ndarray, heads: np.ndarray, holders: HolderTable
    ) -> GhostNotice | None:
        """Pool ``slot``'s batch evicted segments with keys ``evicted`` and added ones with
        keys ``heads`` (applied to ``holders`` already): its answer."""
        if evicted.size:
            # A copy evicted while another pool still holds the block is no ghost: the
            # block never left the cluster.
            self.ghosts.evicted(slot, evicted[holders.locs(evicted) == 0])
        promote = heads[:0]
        demote: list[int] = []
        if heads.size:
            who, promote = self.ghosts.added(slot, heads)
            for other in np.unique(who[who != slot]).tolist():
                self._tell(int(other), "returned", promote[who == other].tolist())
            extra = []
            for bid, slots in holders.whole_copies(heads):
                if slot not in slots:
                    continue  # gone again meanwhile
                self.duplicates += 1
                seen = slots[0]
                if seen == slot:
                    extra.append(bid)  # the new copy is the one read: as a ghost hit
                else:
                    demote.append(bid)
                    self._tell(seen, "reused", [bid])
                for other in slots[1:]:
                    if other != slot:
                        self._tell(other, "demote", [bid])
            if extra:
                promote = np.concatenate((promote, np.array(extra, dtype=np.uint64)))
        waiting = self._pending.pop(slot, {})
        if not (promote.size or demote or waiting):
            return None

        def ids(kind: str, more: list[int] | None = None) -> np.ndarray:
            return np.array([*waiting.get(kind, ()), *(more or ())], dtype=np.uint64)

        return GhostNotice(promote, ids("returned"), ids("demote", demote), ids("reused"))

    def forget(self, slot: int) -> None:
        """A pool left: its pending news goes."""
        self._pending.pop(slot, None)

    def __len__(self) -> int:
        return len(self.ghosts)

    @property
    def nbytes(self) -> int:
        pending = sum(len(q) for w in self._pending.values() for q in w.values())
        return self.ghosts.nbytes + 8 * pending
