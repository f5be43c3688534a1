"""Small values exchanged between clients, block pools and the index."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from ray import ObjectRef

RAY_NAMESPACE = "kvray"
"""Every kvray actor lives in this Ray namespace; a kvray namespace is a name prefix inside it."""


def index_name(namespace: str) -> str:
    return f"{namespace}/index"


def pool_name(namespace: str, node_id: str) -> str:
    return f"{namespace}/pool/{node_id}"


def pool_prefix(namespace: str) -> str:
    return f"{namespace}/pool/"


@dataclass(frozen=True)
class PutResult:
    """What happened to the blocks of one ``put``: every block is counted exactly once."""

    stored: int = 0
    duplicate: int = 0
    refused: int = 0

    def __add__(self, other: PutResult) -> PutResult:
        return PutResult(
            self.stored + other.stored,
            self.duplicate + other.duplicate,
            self.refused + other.refused,
        )


@dataclass(frozen=True)
class BlockLoc:
    """Where one leased block lives: item ``pos`` of segment object ``seg_id``."""

    seg_id: int
    pos: int
    nbytes: int
    checksum: int


@dataclass
class LeaseReply:
    """A pool's answer to ``lease``: where each asked-for block is, and refs to read them from.

    The locations are numpy arrays aligned with the keys of the request (``seg_ids[i] == 0``:
    key ``i`` is not held), not a dict of per-key objects: a reply for a 64-block prefix then
    pickles in microseconds instead of about half a millisecond, and it sits on every load's
    critical path. Segments named here are protected from eviction until ``release(lease_id)``
    or expiry.
    """

    lease_id: int
    seg_ids: np.ndarray  # int64; 0 where the key is missing
    positions: np.ndarray  # int64; item of the segment object
    nbytes: np.ndarray  # int64
    checksums: np.ndarray  # uint64
    segments: dict[int, ObjectRef] = field(default_factory=dict)

    @classmethod
    def empty(cls, lease_id: int, n: int) -> LeaseReply:
        z = np.zeros(n, dtype=np.int64)
        return cls(lease_id, z, z.copy(), z.copy(), np.zeros(n, dtype=np.uint64))

    @property
    def num_found(self) -> int:
        return int(np.count_nonzero(self.seg_ids))

    def loc(self, i: int) -> BlockLoc | None:
        """Where key ``i`` of the request is (None when the pool does not hold it)."""
        seg = int(self.seg_ids[i])
        if seg == 0:
            return None
        return BlockLoc(seg, int(self.positions[i]), int(self.nbytes[i]), int(self.checksums[i]))


@dataclass(frozen=True)
class Inventory:
    """Everything a pool holds, for the index to rebuild from."""

    node_id: str
    incarnation: str
    version: int
    keys: list[bytes]


@dataclass(frozen=True)
class NodeInfo:
    """One pool as the index and its clients see it."""

    node_id: str
    pool_name: str
    capacity: int


@dataclass(kw_only=True)
class Changes:
    """One answer of the index's change feed.

    ``snapshot`` is set when the client must drop its view and rebuild (first call, index
    restart, or the client fell behind the bounded log). ``records`` are applied in order;
    each is (node slot, keys added on it, keys removed from it).
    """

    epoch: str
    seq: int
    nodes: dict[int, NodeInfo]
    snapshot: bool = False
    #: The index is being stopped (``kvray.stop``): clients stop polling.
    stopped: bool = False
    records: list[tuple[int, list[bytes], list[bytes]]] = field(default_factory=list)
