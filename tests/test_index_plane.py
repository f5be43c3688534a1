"""The metadata plane on a real cluster: one entry per block with shards in different pools,
id collisions, a sharded index that rebuilds per shard, and subscribers only where needed."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster
from ray_fixtures import started_namespace
from store_helpers import wait_for

import kvray
from kvray.meta.holders import PLACEMENT_BASE
from kvray.meta.ids import index_shard_of, key_ids
from kvray.meta.messages import RAY_NAMESPACE, index_name, pool_name


def _node_with(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


@ray.remote(num_cpus=0)
def _put_shard(ns: str, keys: list[bytes], shard: int, nshards: int, fill: int) -> dict:
    store = kvray.connect(ns, subscribe=False)
    assert store.feed is None
    blocks = np.full((len(keys), 4096), fill, dtype=np.uint8)
    r = store.io.put(keys, key_ids(keys), shard, nshards, blocks).result(timeout=60)
    store.close()
    return r.__dict__


def test_a_block_is_visible_only_with_every_shard_even_across_pools(kvray_ns: str) -> None:
    """TP=2 over two nodes: rank 0's shards in node A's pool, rank 1's in node B's. A block
    is one index entry; it appears once both shards are stored, at a placement naming a pool
    per shard, and each rank reads its own shard from its own pool."""
    keys = [uuid.uuid4().bytes + b"tp2" for _ in range(6)]
    ids = key_ids(keys)
    store = kvray.connect(kvray_ns)
    on_a = _put_shard.options(resources={"node_a": 0.01})
    on_b = _put_shard.options(resources={"node_b": 0.01})
    assert ray.get(on_a.remote(kvray_ns, keys, 0, 2, 10))["stored"] == 6
    store.sync()
    assert store.lookup(keys) == 0, "half a block is not a block"
    assert ray.get(on_b.remote(kvray_ns, keys[:4], 1, 2, 11))["stored"] == 4
    store.sync()
    assert store.lookup(keys) == 4
    view = store.feed.view
    locs = view.locs(ids[:4])
    assert (locs >= PLACEMENT_BASE).all()
    slot_a, slot_b = (
        next(s for s, n in view.nodes.items() if n.node_id == _node_with(r))
        for r in ("node_a", "node_b")
    )
    assert view.slot_of(ids[:4], locs, 0).tolist() == [slot_a] * 4
    assert view.slot_of(ids[:4], locs, 1).tolist() == [slot_b] * 4
    for shard, fill in ((0, 10), (1, 11)):
        slots = view.slot_of(ids[:4], locs, shard)
        got = store.fetch_from(keys[:4], ids[:4], shard, slots, view.pool_names(), 30)
        assert len(got.keys) == 4 and store.verify(got) == 4
        assert all((a == fill).all() for a in got.arrays)
    # A shard from the wrong pool is not found (pools key shards by number).
    wrong = store.fetch_from(keys[:1], ids[:1], 1, [slot_a], view.pool_names(), 30)
    assert wrong.keys == [] and "evicted or never stored" in wrong.reason
    # One shard lost anywhere makes the block invisible again.
    pool_b = ray.get_actor(pool_name(kvray_ns, _node_with("node_b")), namespace=RAY_NAMESPACE)
    assert ray.get(pool_b.report_lost.remote(keys[1:2], ids[1:2], 1)) == 1
    store.sync()
    assert store.lookup(keys) == 1
    # The index holds one entry per block, whatever the shard count.
    stats = store.stats()
    assert stats["index"]["keys"] == 6 and stats["totals"]["blocks"] == 6 + 3
    store.close()


def test_an_id_collision_never_serves_another_keys_bytes(
    kvray_ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two keys forced onto one id: the view cannot tell them apart, the pool can (it keeps
    full keys): the second key reads as not found, and a put of it is refused."""
    import kvray.client

    a, b = b"collision-key-a", b"collision-key-b"
    store = kvray.connect(kvray_ns)
    block = np.arange(256, dtype=np.uint8)
    assert store.put([a], [block]).result(timeout=30).stored == 1
    store.sync()
    real = kvray.client.key_ids

    def colliding(keys: list[bytes]) -> np.ndarray:
        return real([a if k == b else k for k in keys])

    monkeypatch.setattr(kvray.client, "key_ids", colliding)
    assert store.lookup([b]) == 1, "the view sees the id"
    with pytest.raises(kvray.BlockLostError) as info:
        store.get([b])
    assert info.value.keys == [b] and "never stored" in info.value.reason
    fetched = store.fetch([b])
    assert fetched.keys == [] and fetched.reason
    assert [x.tobytes() for x in store.get([a])] == [block.tobytes()]
    # Without a view (a worker's store), the put reaches the pool, which refuses it.
    writer = kvray.connect(kvray_ns, subscribe=False)
    r = writer.io.put([b], colliding([b]), 0, 1, [np.zeros(256, dtype=np.uint8)]).result(30)
    assert (r.stored, r.refused) == (0, 1)
    me = ray.get_runtime_context().get_node_id()
    pool = ray.get_actor(pool_name(kvray_ns, me), namespace=RAY_NAMESPACE)
    assert ray.get(pool.stats.remote())["collisions"] >= 2
    writer.close()
    store.close()


@pytest.fixture
def sharded_ns(ray_cluster: Cluster) -> Iterator[str]:
    with started_namespace("sh", index_shards=3) as ns:
        yield ns


@pytest.mark.slow
def test_sharded_index_rebuilds_one_shard_and_purges_a_lost_node(
    sharded_ns: str, ray_cluster: Cluster
) -> None:
    ns = sharded_ns
    store = kvray.connect(ns)
    assert store.num_index_shards == 3
    keys = [b"sharded-%d" % i for i in range(300)]
    ids = key_ids(keys)
    owner = index_shard_of(ids, 3)
    assert set(owner.tolist()) == {0, 1, 2}
    blocks = np.random.default_rng(0).integers(0, 255, (300, 1024), dtype=np.uint8)
    assert store.put(keys, blocks).result(timeout=60).stored == 300
    store.sync()
    assert store.lookup(keys) == 300
    per_shard = [
        ray.get(ray.get_actor(index_name(ns, i), namespace=RAY_NAMESPACE).stats.remote())
        for i in range(3)
    ]
    assert [s["keys"] for s in per_shard] == np.bincount(owner, minlength=3).tolist()
    # Shard 1 restarts (a crash): it rebuilds its range from the pools; the others never
    # lose a block, and every view catches up.
    shard1 = ray.get_actor(index_name(ns, 1), namespace=RAY_NAMESPACE)
    epoch = ray.get(shard1.current.remote())[0]
    ray.kill(shard1, no_restart=False)
    wait_for(lambda: ray.get(shard1.current.remote(), timeout=30)[0] != epoch, 60, "a restart")
    wait_for(lambda: (ray.get(shard1.locate.remote(ids[owner == 1])) > 0).all(), 30, "rebuild")
    wait_for(lambda: store.lookup(keys) == 300, 30, "the view to catch up")
    assert [x.tobytes() for x in store.get(keys[:5])] == [blocks[i].tobytes() for i in range(5)]
    # A node with blocks in every shard's range dies: each shard purges its part.
    node = ray_cluster.add_node(num_cpus=1, object_store_memory=128 << 20, resources={"node_x": 1})
    ray_cluster.wait_for_nodes()
    wait_for(lambda: len(store.feed.view.nodes) == 4, 30, "a pool on the new node")
    lost = [b"lost-%d" % i for i in range(60)]

    @ray.remote(num_cpus=0, resources={"node_x": 0.01})
    def put_there() -> int:
        s = kvray.connect(ns)
        n = s.put(lost, np.ones((60, 512), dtype=np.uint8)).result(timeout=60).stored
        s.close()
        return n

    assert ray.get(put_there.remote()) == 60
    store.sync()
    assert store.lookup(lost) == 60
    assert set(index_shard_of(key_ids(lost), 3).tolist()) == {0, 1, 2}
    ray_cluster.remove_node(node)
    wait_for(
        lambda: store.lookup(lost[:1]) == 0 and not store.feed.view.contains(key_ids(lost)).any(),
        30,
        "the purge",
    )
    assert store.lookup(keys) == 300
    store.close()


@pytest.mark.slow
def test_a_view_of_a_stopped_index_is_cleared_and_reconnects(ray_cluster: Cluster) -> None:
    """An index shard killed for good: the view forgets its blocks at once (no lookup may
    report blocks nobody can vouch for), and finds the index again when kvray is restarted."""
    ns = f"stale{uuid.uuid4().hex[:6]}"
    kvray.start(namespace=ns, capacity="32MiB", health_check_interval_s=0.5)
    try:
        store = kvray.connect(ns)
        keys = [b"stale-%d" % i for i in range(20)]
        store.put(keys, np.ones((20, 256), dtype=np.uint8)).result(timeout=30)
        store.sync()
        assert store.lookup(keys) == 20
        ray.kill(ray.get_actor(index_name(ns, 0), namespace=RAY_NAMESPACE), no_restart=True)
        wait_for(lambda: store.lookup(keys) == 0, 20, "the view to be cleared")
        assert not store.closed
        kvray.start(namespace=ns, capacity="32MiB", health_check_interval_s=0.5)
        wait_for(lambda: store.lookup(keys) == 20, 30, "the view to come back")
        # Puts never needed the index: they go to the local pool by name.
        assert store.put([b"after"], [np.ones(64, dtype=np.uint8)]).result(30).stored == 1
        store.close()
    finally:
        kvray.stop(ns)


def test_only_subscribers_run_a_feed(kvray_ns: str) -> None:
    before = {t.name for t in threading.enumerate()}
    writer = kvray.connect(kvray_ns, subscribe=False)
    assert writer.feed is None
    assert "kvray-feed" not in {t.name for t in threading.enumerate()} - before
    with pytest.raises(kvray.InvalidArgumentError, match="subscribe=True"):
        writer.lookup([b"x"])
    reader = kvray.connect(kvray_ns)
    assert reader.feed is not None
    writer.close()
    reader.close()
