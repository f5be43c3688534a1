"""Names and small values exchanged between clients, block pools, index shards and the reconciler.

Ray-free (the core of kvray): :mod:`kvray.meta.view`, the client, the actors and the connector
all read these; Ray's ``ObjectRef`` is only named in annotations.

Everything per block travels as numpy arrays aligned with a request (ids, shard numbers, codes),
never as per-block Python objects: a batch of a million blocks pickles as a few buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ray import ObjectRef

RAY_NAMESPACE = "kvray"
"""Every kvray actor lives in this Ray namespace; a kvray namespace is a name prefix inside it."""

INLINE_BYTES = 96 << 10
"""Block bytes that travel inside the call itself: a put segment or a read of at most this many
bytes goes by value (Ray inlines an argument or a return value under its
``max_direct_call_object_size``, 100 KiB by default) instead of through the object store,
which costs a ``ray.put`` and an owner's lookup on each side (measured on a 2-core node: a
96 KiB argument 1.7 ms a call, the same by ``ray.put`` and ref 3.6 ms)."""


def control_name(namespace: str) -> str:
    return f"{namespace}/control"


def index_name(namespace: str, shard: int = 0) -> str:
    return f"{namespace}/index/{shard}"


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


@dataclass
class LeaseReply:
    """A pool's answer to ``lease``: where each asked-for block is, and refs to read them from.

    Numpy arrays aligned with the keys of the request (``seg_ids[i] == 0``: key ``i`` is not
    served: not held, its id matched another key, or ``reasons[i]`` says why); segments named
    here are protected from eviction until released or the lease expires. A negative id names
    an object of blocks served straight from a disk file, held until the lease goes.
    """

    lease_id: int
    seg_ids: np.ndarray  # int64; 0 where the key is missing
    positions: np.ndarray  # int64; item of the segment object
    nbytes: np.ndarray  # int64
    checksums: np.ndarray  # uint64
    segments: dict[int, ObjectRef] = field(default_factory=dict)
    #: Why a held key was not served (a corrupt or unreadable file, no room), by key index.
    reasons: dict[int, str] = field(default_factory=dict)
    #: Segments served by value (a small read, see :data:`INLINE_BYTES`): id -> the blocks
    #: asked for, in the order of their (remapped) positions; no lease holds them.
    inline: dict[int, object] = field(default_factory=dict)

    @classmethod
    def empty(cls, lease_id: int, n: int) -> LeaseReply:
        z = np.zeros(n, dtype=np.int64)
        return cls(lease_id, z, z.copy(), z.copy(), np.zeros(n, dtype=np.uint64))

    def point(self, i: int, seg_id: int, pos: int, nbytes: int, checksum: int) -> None:
        """Key ``i`` is item ``pos`` of object ``seg_id``: ``nbytes`` bytes, ``checksum``."""
        self.seg_ids[i] = seg_id
        self.positions[i] = pos
        self.nbytes[i] = nbytes
        self.checksums[i] = checksum

    @property
    def num_found(self) -> int:
        return int(np.count_nonzero(self.seg_ids))


@dataclass(frozen=True)
class ShardBatch:
    """A pool's changes for one index shard: shards of blocks it now holds / no longer holds."""

    add_ids: np.ndarray  # uint64
    add_shards: np.ndarray  # uint16
    add_nshards: np.ndarray  # uint16
    rm_ids: np.ndarray  # uint64
    rm_shards: np.ndarray  # uint16
    #: No id repeats among the additions (skips grouping them).
    add_unique: bool = False
    #: Keys (first block ids) of the segments the pool's policy evicted, and of those it
    #: added, for the cluster's ghosts (:mod:`kvray.meta.ghosts`); empty under ``lru``.
    ghosts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    heads: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))

    def __len__(self) -> int:
        return int(self.add_ids.size + self.rm_ids.size)


def _no_ids() -> np.ndarray:
    return np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True)
class GhostNotice:
    """An index shard's answer to a pool's batch, when the cluster's ghosts or copies have
    news for it (:class:`kvray.meta.news.ClusterNews`): keys of segments it added that were
    ghosts elsewhere or copies of a block other pools hold (``promote``: they skip
    probation), keys of its own ghosts that came back in other pools (``returned``: its
    policy's evidence), block ids of its copies that another pool's copy hides from readers
    (``demote``: evicted first, as they are never read), and block ids of its copies readers
    see that another pool put again (``reused``: a read, as the put was one missed)."""

    promote: np.ndarray  # uint64
    returned: np.ndarray  # uint64
    demote: np.ndarray = field(default_factory=_no_ids)  # uint64
    reused: np.ndarray = field(default_factory=_no_ids)  # uint64


@dataclass(frozen=True)
class Inventory:
    """Everything a pool holds of one index shard's id range, for that shard to rebuild from."""

    slot: int
    incarnation: str
    version: int
    ids: np.ndarray  # uint64
    shards: np.ndarray  # uint16
    nshards: np.ndarray  # uint16


@dataclass(frozen=True)
class NodeInfo:
    """One pool as clients see it: its slot in location codes, node, actor name, capacity."""

    slot: int
    node_id: str
    pool_name: str
    capacity: int


@dataclass(frozen=True)
class PoolStatus:
    """One pool as the reconciler last saw it (pushed to every index shard each tick)."""

    info: NodeInfo
    alive: bool
    incarnation: str = ""
    #: The pool's update version per index shard (what each shard should have applied).
    versions: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReplicaInfo:
    """A vLLM engine that reports its own KV cache (the engine tier), as routers see it.

    ``slot`` is its bit in the engine tier's holder masks (0-63, given by index shard 0);
    ``key`` the Serve replica's unique id (or ``host:pid`` outside Serve); ``incarnation``
    changes at every engine start, so a restarted engine never inherits the old one's blocks.
    """

    slot: int
    key: str
    node_id: str
    incarnation: str
    #: Fraction of the engine's KV blocks in use (0-1) at its last report.
    usage: float = 0.0
    #: Engine blocks it holds (as last reported).
    blocks: int = 0
    #: Its cost estimates (:meth:`kvray.meta.costs.Costs.to_wire`: a few floats, -1 for
    #: unknown; empty from an engine that measures nothing yet, or an older one).
    costs: tuple[float, ...] = ()


def _empty_ids() -> np.ndarray:
    return np.zeros(0, dtype=np.uint64)


@dataclass(kw_only=True)
class Changes:
    """One answer of an index shard's change feed.

    ``snapshot``: the client drops what it holds of this shard and loads ``ids``/``locs``
    (first call, index restart, or the client fell behind the bounded log). Otherwise the
    records are applied in order (a later record of an id wins): ``locs[i] == 0`` means block
    ``ids[i]`` is no longer visible, else it is visible at location code ``locs[i]``
    (:mod:`kvray.meta.holders`). ``placements`` resolves every placement code in ``locs``.
    """

    index_shard: int
    epoch: str
    seq: int
    ids: np.ndarray
    locs: np.ndarray
    placements: dict[int, tuple[int, ...]] = field(default_factory=dict)
    nodes: dict[int, NodeInfo] = field(default_factory=dict)
    nodes_version: int = 0
    snapshot: bool = False
    #: Engine tier (never a load source): ``engine_masks[i]`` is the set of replica slots
    #: (bit ``r``: :class:`ReplicaInfo` ``slot == r``) whose engine cache holds block
    #: ``engine_ids[i]``; 0: none any more. Applied like ``ids``/``locs``.
    engine_ids: np.ndarray = field(default_factory=_empty_ids)
    engine_masks: np.ndarray = field(default_factory=_empty_ids)
    #: Engines reporting to this shard, by slot (replaces the previous answer's).
    replicas: dict[int, ReplicaInfo] = field(default_factory=dict)
    #: The index is being stopped (``kvray.stop``): clients clear their view of it.
    stopped: bool = False
