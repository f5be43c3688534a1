"""The cluster's ghosts and the ``aged`` policy (issue 35): hand-made sequences where the
policy must differ from LRU or from ``adaptive``, the index shards' ghost table, a segment
evicted on one node and put again on another skipping probation there (the evicting pool
getting the evidence), and a pool keeping a put sent by value as segments of its
``segment_bytes``, its tail first; all through the store API on the session's Ray cluster."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import ray
from ray_fixtures import started_namespace
from test_eviction import roomy_reuse, tight_reuse

from kvray.meta.eviction import AgedPolicy, LRUPolicy, make_policy, simulate
from kvray.meta.ghosts import ClusterGhosts
from kvray.meta.holders import HolderTable
from kvray.meta.news import ClusterNews


def _random_trace(seed: int, n: int = 600) -> list[list[int]]:
    """Chains over a Zipf-popular set of prefixes, each with a one-off tail."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        head = int(rng.zipf(1.3)) % 200
        out.append([10 * head + j for j in range(int(rng.integers(1, 6)))] + [10**6 + i])
    return out


def test_aged_at_weight_one_is_exactly_lru() -> None:
    """At ``k = 1`` the victim is the oldest entry of either queue: LRU over the segments."""
    for seed in range(3):
        reqs = _random_trace(seed)
        lru = simulate(reqs, 60, LRUPolicy())
        aged = simulate(reqs, 60, AgedPolicy(60, start=1.0, low=1.0, high=1.0))
        assert (aged.hit_blocks, aged.evicted_entries) == (lru.hit_blocks, lru.evicted_entries)


def test_aged_keeps_the_doorkeeper_where_reuse_comes_back_beyond_the_capacity() -> None:
    """Tight: a 5-block chain read every 10 requests, 27 one-off blocks between (more than the
    20-block cache). LRU never hits it; ``aged`` keeps it, and its weight grows (every read of
    the chain is one LRU would have lost)."""
    reqs = tight_reuse()
    pol = make_policy("aged", 20)
    got = simulate(reqs, 20, pol).hit_rate
    assert simulate(reqs, 20, "lru").hit_rate == 0.0
    assert got >= simulate(reqs, 20, "probation").hit_rate > 0.15
    assert pol.stats()["lru_would_miss"] >= 50 and pol.stats()["probation_weight_pct"] > 200


def test_aged_turns_to_lru_where_lru_would_have_hit() -> None:
    """Roomy: every 2-block chain is read once, 4 chains after its put. ``probation`` loses
    each before that read; ``aged`` sees the ghosts come back within the capacity, falls to
    ``k = 1`` and hits what LRU hits, less the return it learnt from."""
    reqs = roomy_reuse()
    pol = make_policy("aged", 20)
    aged = simulate(reqs, 20, pol).hit_rate
    lru = simulate(reqs, 20, "lru").hit_rate
    assert simulate(reqs, 20, "probation").hit_rate < 0.05
    assert lru > 0.45 and aged >= 0.99 * lru
    assert pol.stats()["lru_would_hit"] >= 1 and pol.stats()["probation_weight_pct"] == 100


def test_cluster_ghosts_tell_who_evicted_and_stay_bounded() -> None:
    g = ClusterGhosts(per_entry=2, floor=4)
    g.added(0, [10, 11, 12, 13, 14, 15])  # six segments live
    g.evicted(0, [10, 11])
    g.evicted(1, [12])
    who, keys = g.added(2, [11, 12, 99])
    assert dict(zip(keys.tolist(), who.tolist(), strict=True)) == {11: 0, 12: 1}
    who, keys = g.added(3, [11])  # a return is forgotten: it is back
    assert not keys.size
    for i in range(100):  # evictions only: the limit falls to the floor, oldest forgotten
        g.evicted(0, [1000 + i])
    assert len(g) == 4 and g.forgotten >= 96
    assert g.added(1, [1099])[1].tolist() == [1099]
    assert not g.added(1, [1000])[1].size
    assert g.nbytes < 4096


def test_shared_ghosts_give_a_segment_put_again_elsewhere_its_return() -> None:
    """Two pools, requests alternating: a chain evicted unread from one pool comes back in the
    other; with each pool's ghosts its own it is a stranger there, with the cluster's it skips
    probation, and the evicting pool counts a hit LRU would have had."""
    reqs: list[list[int]] = []
    k = 10**6
    for r in range(40):
        if r % 8 == 0:
            reqs.append([1, 2, 3, 4])
        reqs.append([k, k + 1, k + 2])
        k += 10
    own = simulate(reqs, 30, "probation", nodes=2)
    shared = simulate(reqs, 30, "probation", nodes=2, shared_ghosts=True)
    assert shared.hit_blocks > own.hit_blocks


# ---------------------------------------------------------------------- through the store
def _held(h: HolderTable, slot: int, ids: list[int]) -> None:
    n = len(ids)
    h.add(slot, np.array(ids, np.uint64), np.zeros(n, np.uint16), np.ones(n, np.uint16))


def test_a_block_put_in_two_pools_demotes_the_copy_no_reader_sees() -> None:
    """Readers read the lowest slot's copy of a block two pools hold whole. The index's news:
    the hidden copy is demoted (told at once when it is the batch's own, else with its pool's
    next answer); the read copy is reused (or promoted, when it is the new one)."""
    h, news = HolderTable(), ClusterNews()
    none = np.zeros(0, dtype=np.uint64)
    _held(h, 0, [7, 8])
    assert news.batch(0, none, np.array([7], np.uint64), h) is None  # one copy: no news
    _held(h, 1, [7, 8])  # slot 1's copy: hidden behind slot 0's
    got = news.batch(1, none, np.array([7], np.uint64), h)
    assert got is not None and got.demote.tolist() == [7] and not got.promote.size
    told = news.batch(0, none, none, h)
    assert told is not None and told.reused.tolist() == [7] and not told.demote.size
    _held(h, 2, [30])
    _held(h, 1, [30])  # the new copy has the lower slot: it is read (promoted), 2's hidden
    got = news.batch(1, none, np.array([30], np.uint64), h)
    assert got is not None and got.promote.tolist() == [30] and not got.demote.size
    assert news.batch(2, none, none, h).demote.tolist() == [30]  # type: ignore[union-attr]
    assert news.batch(0, none, none, h) is None
    assert news.duplicates == 2
    _held(h, 2, [31])
    _held(h, 0, [31])
    news.batch(0, none, np.array([31], np.uint64), h)  # 2's copy of 31 is hidden now
    news.forget(2)  # slot 2 left: its news goes
    assert news.batch(2, none, none, h) is None


@pytest.mark.parametrize("name", ["lru", "probation", "adaptive", "aged"])
def test_a_demoted_entry_is_the_first_victim(name: str) -> None:
    pol = make_policy(name, 100)
    for eid in (1, 2, 3):
        pol.insert(eid, 10, 1, key=100 + eid)
    pol.touch([1], [10])  # read: in main, the most recent
    pol.demote(1)
    assert next(pol.victims(lambda e: True)) == 1
    if name != "lru":
        assert pol.stats()["demoted"] == 1


BLOCK = 16 << 10


@ray.remote(num_cpus=0)
class _Writer:
    def __init__(self, ns: str) -> None:
        import kvray

        self.store = kvray.connect(ns, subscribe=False)

    def put(self, keys: list[bytes], seed: int) -> int:
        data = np.random.default_rng(seed).integers(0, 256, (len(keys), BLOCK), dtype=np.uint8)
        return self.store.put(keys, data).result(timeout=30).stored

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def _pool(store: Any, node: str) -> dict[str, Any]:
    return store.stats()["nodes"][node]


def _wait(cond: Any, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_segment_evicted_on_one_node_skips_probation_on_another(ray_cluster: object) -> None:
    """Node A's pool evicts an unread chain (a one-off scan pushes it out); node B puts it
    again: B's pool is told by the index shard that it is a ghost (promoted: a cluster ghost
    hit), and A's pool, in the answer to its next batch, that its ghost came back within the
    capacity (a hit LRU would have had; measured when A hears of it, so the traffic A took
    meanwhile counts in the distance). Every byte reads back."""
    import kvray

    with started_namespace("gh", capacity="1MiB", eviction_policy="aged") as ns:
        a = _Writer.options(resources={"node_a": 0.01}).remote(ns)
        b = _Writer.options(resources={"node_b": 0.01}).remote(ns)
        node_a, node_b = ray.get([a.node.remote(), b.node.remote()], timeout=60)
        chain = [f"chain/{i}".encode() for i in range(4)]
        with kvray.connect(ns) as store:
            assert ray.get(a.put.remote(chain, 1), timeout=60) == 4
            for i in range(15):  # 60 one-off blocks: A is full (64 blocks of 16 KiB)
                keys = [f"one/{i}/{j}".encode() for j in range(4)]
                assert ray.get(a.put.remote(keys, 100 + i), timeout=60) == 4
            # One block more: the chain goes first (never read), and leaves room for one/y.
            assert ray.get(a.put.remote([b"one/x"], 9), timeout=60) == 1
            store.sync()
            assert store.lookup(chain) == 0  # the chain went first: never read
            assert ray.get(b.put.remote(chain, 1), timeout=60) == 4
            _wait(lambda: _pool(store, node_b)["policy_cluster_ghost_hits"] >= 1, "B's promotion")
            # A's next batch (one block: the ghost stays within the capacity's distance)
            assert ray.get(a.put.remote([b"one/y"], 8), timeout=60) == 1
            _wait(lambda: _pool(store, node_a)["policy_ghosts_returned"] >= 1, "A's evidence")
            assert _pool(store, node_a)["policy_lru_would_hit"] == 1, _pool(store, node_a)
            store.sync()
            want = np.random.default_rng(1).integers(0, 256, (4, BLOCK), dtype=np.uint8)
            got = store.get(chain)
            assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
            shards = store.stats()["index"]["shards"]
            assert sum(s.get("ghost_returns", 0) for s in shards) >= 1
            # A puts the chain again (its lookup raced B's put): two copies, one read. The
            # pool whose copy readers do not see demotes it, in the answer to its own batch
            # or to its next one.
            assert ray.get(a.put.remote(chain, 1), timeout=60) == 4
            assert ray.get(b.put.remote([b"one/z"], 7), timeout=60) == 1
            assert ray.get(a.put.remote([b"one/w"], 6), timeout=60) == 1

            def demoted() -> list[int]:
                return [_pool(store, n).get("policy_demoted", 0) for n in (node_a, node_b)]

            _wait(lambda: sum(demoted()) == 1, "the hidden copy's demotion")
            shards = store.stats()["index"]["shards"]
            assert sum(s.get("duplicate_segments", 0) for s in shards) == 1
            store.sync()
            got = store.get(chain)
            assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_pool_keeps_a_put_as_segments_of_its_segment_bytes_tail_first(
    ray_cluster: object,
) -> None:
    """24 blocks of 4 KiB sent by value to a pool whose ``segment_bytes`` is 32 KiB are three
    segments; every byte reads back; when RAM must evict one of them (LRU) it is the tail's,
    so the longest prefix held is 16 blocks, not none."""
    import kvray

    with (
        started_namespace("sg", capacity="1MiB", segment_bytes="32KiB") as ns,
        kvray.connect(ns) as store,
    ):
        rng = np.random.default_rng(3)
        chain = [f"c/{i}".encode() for i in range(24)]
        data = rng.integers(0, 256, (24, 4096), dtype=np.uint8)
        assert store.put(chain, data).result(timeout=30).stored == 24
        store.sync()
        pools = [p for p in store.stats()["nodes"].values() if p.get("segments")]
        assert [p["segments"] for p in pools] == [3]
        got = store.get(chain)
        assert all(np.array_equal(g, d) for g, d in zip(got, data, strict=True))
        # 1 MiB holds 256 blocks: 232 more one-off blocks fill it, 8 more evict one
        # segment (the read touched the chain's tail first: its head is the most recent)
        for i in range(30):
            keys = [f"o/{i}/{j}".encode() for j in range(8)]
            block = rng.integers(0, 256, (8, 4096), dtype=np.uint8)
            store.put(keys, block).result(timeout=30)
        store.sync()
        assert store.lookup(chain) == 16
