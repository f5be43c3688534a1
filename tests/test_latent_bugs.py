"""Issue 33's latent bugs, each pinned by a test that failed before its fix.

- A refused store piece is never lost: the pieces of a store job complete on several put
  threads, and a refusal reported by one must survive another reporting success at the same
  moment (``one_done`` read-modify-wrote the job's failure flag outside the lock).
- A load's placements are its own: placement codes are numbered per index shard, so with two
  index shards the same code names different pools; a load plan that keyed placements by code
  sent a rank to the wrong pool (a silent miss and a recompute).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster
from ray_fixtures import started_namespace

import kvray
from kvray.connector.keyspace import EngineKeySpace
from kvray.connector.manager import KVRayCacheManager
from kvray.connector.metadata import (
    KVRayConnectorMetadata,
    LoadSpec,
    StoreSpec,
)
from kvray.connector.saves import Outbox, PutTracker
from kvray.keys import LayoutFingerprint
from kvray.meta.holders import PLACEMENT_BASE
from kvray.meta.ids import index_shard_of, key_ids
from kvray.meta.messages import PutResult


class _SlowOk:
    """A put's result whose ``refused`` is read only after the other piece has reported."""

    def __init__(self, reading: threading.Event, other_done: threading.Event) -> None:
        self._reading = reading
        self._other_done = other_done

    @property
    def refused(self) -> int:
        self._reading.set()
        self._other_done.wait(2.0)  # bounded: a fixed callback may hold a lock meanwhile
        return 0


def test_a_refused_piece_is_not_lost_to_a_piece_succeeding_at_the_same_time() -> None:
    puts = PutTracker(Outbox())
    ok_piece: Future[PutResult] = Future()
    refused_piece: Future[PutResult] = Future()
    puts.track(7, StoreSpec("r", [0, 1], [b"a", b"b"]), [ok_piece, refused_piece], ok=True)
    reading, other_done = threading.Event(), threading.Event()
    t = threading.Thread(target=ok_piece.set_result, args=(_SlowOk(reading, other_done),))
    t.start()
    assert reading.wait(5.0)
    refused_piece.set_result(PutResult(stored=0, refused=1))
    other_done.set()
    t.join(10.0)
    assert not t.is_alive()
    assert puts.outbox.meta.completed_jobs == {7: 1}
    assert puts.outbox.meta.failed_jobs == {7: 1}, "the refusal was lost: no replan"


BLOCK = 1024


@ray.remote(num_cpus=0)
def _put_rank(ns: str, keys: list[bytes], rank: int, fill: list[int]) -> int:
    store = kvray.connect(ns, subscribe=False)
    blocks = np.stack([np.full(BLOCK, f, dtype=np.uint8) for f in fill])
    r = store.put_shard(keys, key_ids(keys), rank, 2, blocks).result(timeout=60)
    store.close()
    return r.stored


@pytest.fixture
def two_index_shards(ray_cluster: Cluster) -> Iterator[str]:
    with started_namespace("pl", index_shards=2) as ns:
        yield ns


def test_loads_in_one_step_read_split_blocks_from_the_right_pools(two_index_shards: str) -> None:
    """TP=2 across nodes A and B, two index shards. Blocks the first index shard owns have
    rank 0's part on A and rank 1's on B; blocks the second owns, the other way round. Each
    shard numbers its first placement ``PLACEMENT_BASE``, so the two loads of one step name the
    same code for opposite pools: every rank must still read its own part, bytes equal."""
    ns = two_index_shards
    fp = LayoutFingerprint("placements", "f32", 32, "sha256", "test")
    ks = EngineKeySpace(
        fp, num_shards=2, block_size=32, block_nbytes=BLOCK, num_layers=1, tp_size=2,
        total_heads=2,
    )  # fmt: skip
    by_shard: dict[int, list[bytes]] = {0: [], 1: []}
    while min(len(v) for v in by_shard.values()) < 3:
        h = os.urandom(32)
        by_shard[int(index_shard_of(ks.block_ids([h]), 2)[0])].append(h)
    hashes = {s: v[:3] for s, v in by_shard.items()}
    on = {n: _put_rank.options(resources={n: 0.01}) for n in ("node_a", "node_b")}
    # index shard 0: rank 0 on A, rank 1 on B; index shard 1: rank 0 on B, rank 1 on A.
    where = {0: ("node_a", "node_b"), 1: ("node_b", "node_a")}
    fill = {(s, r): [16 * s + 4 * r + i for i in range(3)] for s in (0, 1) for r in (0, 1)}
    for s in (0, 1):
        keys = ks.block_keys(hashes[s])
        for r in (0, 1):
            assert ray.get(on[where[s][r]].remote(ns, keys, r, fill[s, r])) == 3
    store = kvray.connect(ns)
    manager = KVRayCacheManager(ks, store)
    try:
        store.sync()
        assert all(manager.lookup(hashes[s]) == 3 for s in (0, 1))
        loads = {}
        for s in (0, 1):
            plan = manager.prepare_load(hashes[s])
            assert plan.locs == [PLACEMENT_BASE] * 3, "both index shards use the same code"
            loads[s] = LoadSpec(
                f"r{s}", [0, 1, 2], hashes[s], plan.locs, pools=plan.pools,
                placements=plan.placements,
            )  # fmt: skip
        meta = KVRayConnectorMetadata(loads=loads)
        nodes = {n.node_id: slot for slot, n in store.feed.view.nodes.items()}
        node_id = {
            res: next(n["NodeID"] for n in ray.nodes() if n["Alive"] and res in n["Resources"])
            for res in ("node_a", "node_b")
        }
        for s, spec in meta.loads.items():
            keys = ks.block_keys(spec.block_hashes)
            for r in (0, 1):
                slots = spec.slots(r)
                assert slots == [nodes[node_id[where[s][r]]]] * 3, (s, r)
                got = store.fetch_from(keys, key_ids(keys), r, slots, spec.pools, 30)
                assert got.reason == "" and len(got.keys) == 3
                assert [int(a[0]) for a in got.arrays] == fill[s, r]
                assert all((a == a[0]).all() for a in got.arrays)
    finally:
        manager.close()
        store.close()


def test_handoff_plans_of_one_step_each_name_their_own_pools() -> None:
    """A decode plans loads of many handoffs in one step, more split placements (and unknown
    pools) than the locator's old per-process tables held: each load still names, for every
    shard of every block, the pool its prefill put it in."""
    from kvray.connector.handoff import MAX_HANDOFF_POOLS, Handoff, Locator
    from kvray.meta.view import LocalView

    locator = Locator(LocalView(1))
    n = MAX_HANDOFF_POOLS + 8
    handoffs = [Handoff(2, 2, [f"p{i}", f"q{i}"], [(1, (0, 1)), (1, (1, 0))]) for i in range(n)]
    loads = {}
    for i, h in enumerate(handoffs):
        plan = locator.plan(h, 0, 2)
        loads[i] = LoadSpec(
            f"r{i}", [0, 1], [b"x" * 32, b"y" * 32], plan.locs, pools=plan.pools,
            placements=plan.placements,
        )  # fmt: skip
    meta = KVRayConnectorMetadata(loads=loads)
    for i, spec in meta.loads.items():
        names = [[spec.pools[s] for s in spec.slots(shard)] for shard in (0, 1)]
        assert names == [[f"p{i}", f"q{i}"], [f"q{i}", f"p{i}"]], i
