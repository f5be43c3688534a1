"""The cluster block store on a real multi-node Ray cluster (head + simulated nodes A and B)."""

from __future__ import annotations

import os
import uuid

import numpy as np
import psutil
import pytest
import ray
from ray.cluster_utils import Cluster
from store_helpers import corrupt_in_plasma, wait_for

import kvray
from kvray.config import ConfigError
from kvray.meta.ids import key_ids
from kvray.meta.messages import RAY_NAMESPACE, index_name, pool_name

BLOCK = 256 << 10


def _keys(n: int, tag: str = "") -> list[bytes]:
    salt = (tag or uuid.uuid4().hex).encode()
    return [salt + i.to_bytes(4, "big") for i in range(n)]


def _blocks(n: int, nbytes: int = BLOCK, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 255, nbytes, dtype=np.uint8) for _ in range(n)]


@ray.remote(num_cpus=0)
def _put_on_node(ns: str, keys: list[bytes], seed: int, n: int) -> tuple[str, dict]:
    store = kvray.connect(ns)
    result = store.put(keys, _blocks(n, seed=seed)).result(timeout=60)
    node = ray.get_runtime_context().get_node_id()
    store.close()
    return node, result.__dict__


@ray.remote(num_cpus=0)
def _lookup_get_on_node(ns: str, keys: list[bytes]) -> tuple[str, int, list[bytes]]:
    store = kvray.connect(ns)
    store.sync()
    n = store.lookup(keys)
    data = [b.tobytes() for b in store.get(keys[:n])]
    node = ray.get_runtime_context().get_node_id()
    store.close()
    return node, n, data


def test_put_on_node_a_get_on_node_b_bytes_equal(module_ns: str) -> None:
    keys = _keys(12)
    store = kvray.connect(module_ns)
    before = store.stats()
    node_a, result = ray.get(
        _put_on_node.options(resources={"node_a": 0.01}).remote(module_ns, keys, 7, 12)
    )
    assert result == {"stored": 12, "duplicate": 0, "refused": 0}
    node_b, n, data = ray.get(
        _lookup_get_on_node.options(resources={"node_b": 0.01}).remote(module_ns, keys)
    )
    assert node_a != node_b
    assert n == 12
    assert data == [b.tobytes() for b in _blocks(12, seed=7)]
    # The blocks live in node A's pool, not B's.
    stats = store.stats()
    store.close()
    assert stats["nodes"][node_a]["blocks"] == before["nodes"][node_a]["blocks"] + 12
    assert stats["nodes"][node_b]["blocks"] == before["nodes"][node_b]["blocks"]
    assert stats["nodes"][node_a]["hits"] == before["nodes"][node_a]["hits"] + 12


def test_prefix_lengths(module_ns: str) -> None:
    store = kvray.connect(module_ns)
    keys = _keys(8)
    store.put(keys[:5], _blocks(5)).result(timeout=30)
    store.put([keys[6]], _blocks(1)).result(timeout=30)
    store.sync()
    assert store.lookup(keys) == 5
    assert store.lookup(keys[:3]) == 3
    assert store.lookup(keys[5:]) == 0
    assert store.lookup(keys[6:7]) == 1
    assert store.lookup([]) == 0
    index = ray.get_actor(index_name(module_ns), namespace=RAY_NAMESPACE)
    codes = ray.get(index.locate.remote(key_ids(keys)))
    assert (codes[:5] > 0).all() and codes[5] == 0 and codes[6] > 0 and codes[7] == 0
    me = ray.get_runtime_context().get_node_id()
    (my_slot,) = [s for s, n in store.feed.view.nodes.items() if n.node_id == me]
    assert ray.get(index.locate.remote(key_ids(keys[4:6]))).tolist() == [my_slot + 1, 0]
    # A second put of the same keys is counted as duplicates, not stored twice.
    again = store.put(keys[:5], _blocks(5)).result(timeout=30)
    assert again.stored == 0 and again.duplicate == 5
    with pytest.raises(kvray.BlockLostError) as info:
        store.get(keys[4:6])
    assert info.value.keys == [keys[5]]
    store.close()


def test_ten_times_capacity_stays_within_capacity_and_counts_add_up(kvray_ns: str) -> None:
    store = kvray.connect(kvray_ns)
    capacity = 64 << 20
    total_blocks = 10 * capacity // BLOCK
    offered = 0
    results = []
    for batch in range(0, total_blocks, 64):
        keys = _keys(64, tag=f"{kvray_ns}-{batch}")
        results.append(store.put(keys, _blocks(64, seed=batch)))
        offered += 64
        if len(results) % 4 == 0:  # keep a bounded number in flight
            for r in results[-4:]:
                r.result(timeout=60)
    summed = kvray.PutResult()
    for r in results:
        summed = summed + r.result(timeout=60)
    assert summed.stored + summed.duplicate + summed.refused == offered
    assert summed.stored > 0
    stats = store.stats()
    for node in stats["nodes"].values():
        assert node["bytes"] <= node["capacity"]
    totals = stats["totals"]
    assert totals["stored"] == summed.stored
    assert totals["stored"] - totals["evictions"] - totals["lost"] == totals["blocks"]
    assert totals["evictions"] > 0
    assert totals["blocks"] * BLOCK == totals["bytes"]
    store.sync()
    assert stats["index"]["keys"] <= totals["blocks"]
    store.close()


def test_leased_blocks_are_not_evicted_and_unfit_puts_are_refused(kvray_ns: str) -> None:
    store = kvray.connect(kvray_ns)
    me = ray.get_runtime_context().get_node_id()
    pool = ray.get_actor(pool_name(kvray_ns, me), namespace=RAY_NAMESPACE)
    keys = _keys(4)
    store.put(keys, _blocks(4)).result(timeout=30)
    lease = ray.get(pool.lease.remote(keys, key_ids(keys), 0))
    assert lease.num_found == 4 and len(lease.segments) == 1
    wanted = set(key_ids(keys).tolist())
    # Fill the pool several times over while the lease is held.
    for i in range(6):
        store.put(_keys(64, tag=f"fill{i}"), _blocks(64, seed=i)).result(timeout=60)
    assert set(ray.get(pool.inventory.remote()).ids.tolist()) >= wanted
    ray.get(pool.release.remote(lease.lease_id))
    for i in range(6):
        store.put(_keys(64, tag=f"fill2-{i}"), _blocks(64, seed=i)).result(timeout=60)
    inv = set(ray.get(pool.inventory.remote()).ids.tolist())
    assert not wanted & inv, "released blocks are evicted like any other"
    # A block larger than the whole pool can never fit: refused and counted.
    before = ray.get(pool.stats.remote())["refused"]
    big = store.put(_keys(1), [np.ones(65 << 20, dtype=np.uint8)]).result(timeout=60)
    assert big.refused == 1 and big.stored == 0
    assert ray.get(pool.stats.remote())["refused"] == before + 1
    store.close()


@pytest.mark.slow
def test_pool_serves_blocks_after_writer_exits(kvray_ns: str) -> None:
    @ray.remote(num_cpus=0, resources={"node_a": 0.01})
    class Writer:
        def write(self, ns: str, keys: list[bytes]) -> int:
            store = kvray.connect(ns)
            return store.put(keys, _blocks(len(keys), seed=3)).result(timeout=30).stored

        def pid(self) -> int:
            return os.getpid()

    keys = _keys(6)
    writer = Writer.remote()
    assert ray.get(writer.write.remote(kvray_ns, keys)) == 6
    pid = ray.get(writer.pid.remote())
    ray.kill(writer)
    # Simulated nodes share this machine, so the writer's exit is visible as its pid.
    wait_for(lambda: not psutil.pid_exists(pid), 30, "the writer process to exit")
    store = kvray.connect(kvray_ns)
    store.sync()
    got = store.get(keys)
    assert [g.tobytes() for g in got] == [b.tobytes() for b in _blocks(6, seed=3)]
    store.close()


def test_corrupted_bytes_are_detected_and_never_served(module_ns: str) -> None:
    store = kvray.connect(module_ns)
    keys = _keys(3)
    store.put(keys, _blocks(3)).result(timeout=30)
    store.sync()
    me = ray.get_runtime_context().get_node_id()
    pool = ray.get_actor(pool_name(module_ns, me), namespace=RAY_NAMESPACE)
    lost = ray.get(pool.stats.remote())["lost"]
    corrupt_in_plasma(pool, keys[1])
    with pytest.raises(kvray.BlockLostError) as info:
        store.get(keys)
    assert info.value.keys == [keys[1]]
    assert "checksum" in info.value.reason
    wait_for(lambda: store.lookup(keys) == 1, 10, "the corrupt block to leave the index")
    assert [b.tobytes() for b in store.get(keys[:1])] == [_blocks(3)[0].tobytes()]
    assert ray.get(pool.stats.remote())["lost"] == lost + 1
    store.close()


def test_fetch_reads_the_longest_prefix_and_verify_stops_at_corruption(module_ns: str) -> None:
    store = kvray.connect(module_ns)
    keys = _keys(5)
    blocks = _blocks(5, seed=7)
    store.put(keys[:4], blocks[:4]).result(timeout=30)
    store.sync()
    me = ray.get_runtime_context().get_node_id()
    pool = ray.get_actor(pool_name(module_ns, me), namespace=RAY_NAMESPACE)
    before = ray.get(pool.stats.remote())
    # keys[4] was never stored: the prefix stops there, with the reason.
    fetched = store.fetch(keys)
    assert fetched.keys == keys[:4] and "not in the index" in fetched.reason
    assert [a.tobytes() for a in fetched.arrays] == [b.tobytes() for b in blocks[:4]]
    assert store.verify(fetched) == 4
    # A corrupt block is only found by verify: the bytes come back, verify stops before it.
    corrupt_in_plasma(pool, keys[2])
    fetched = store.fetch(keys[:4])
    assert len(fetched.arrays) == 4 and fetched.reason == ""
    assert store.verify(fetched) == 2
    wait_for(lambda: store.lookup(keys) == 2, 10, "the corrupt block to leave the index")
    fetched = store.fetch(keys[:4])
    assert fetched.keys == keys[:2] and fetched.reason
    assert ray.get(pool.stats.remote())["lost"] == before["lost"] + 1
    # Finished reads give their leases back in batches, within about a second.
    wait_for(lambda: ray.get(pool.stats.remote())["active_leases"] == 0, 10, "leases back")
    served = ray.get(pool.stats.remote())["served_bytes"] - before["served_bytes"]
    assert served == (4 + 4 + 2) * BLOCK
    store.close()


def test_connector_halves_in_one_process_share_a_store(module_ns: str) -> None:
    pytest.importorskip("vllm")  # kvray.connector imports vLLM
    from kvray.config import KVRayConfig
    from kvray.connector.attach import close_store, open_store

    cfg = KVRayConfig(namespace=module_ns)
    a, b = open_store(cfg), open_store(cfg)
    assert a is b
    other = open_store(cfg.replace(verify_checksums=False))
    assert other is not a
    close_store(a)
    assert not b.closed, "closed while the other half still uses it"
    close_store(b)
    assert b.closed
    c = open_store(cfg)
    assert c is not a and not c.closed
    close_store(c)
    close_store(other)


def test_namespaces_are_isolated(ray_cluster: Cluster) -> None:
    ns1, ns2 = f"iso{uuid.uuid4().hex[:6]}", f"iso{uuid.uuid4().hex[:6]}"
    kvray.start(namespace=ns1, capacity="16MiB")
    kvray.start(namespace=ns2, capacity="16MiB")
    try:
        s1, s2 = kvray.connect(ns1), kvray.connect(ns2)
        keys = _keys(4, tag="shared-keys")
        s1.put(keys, _blocks(4)).result(timeout=30)
        s1.sync()
        s2.sync()
        assert s1.lookup(keys) == 4
        assert s2.lookup(keys) == 0
        with pytest.raises(kvray.BlockLostError):
            s2.get(keys)
        assert s2.stats()["totals"]["blocks"] == 0
        s1.close()
        s2.close()
    finally:
        kvray.stop(ns1)
        kvray.stop(ns2)


def test_start_is_idempotent_and_connect_needs_start(ray_cluster: Cluster) -> None:
    ns = f"idem{uuid.uuid4().hex[:6]}"
    with pytest.raises(kvray.NotStartedError, match=ns):
        kvray.connect(ns)
    try:
        first = kvray.start(namespace=ns, capacity="8MiB")
        second = kvray.start(namespace=ns, capacity="8MiB")
        assert first["epoch"] == second["epoch"]
        assert second["pools"] == len([n for n in ray.nodes() if n["Alive"]])
    finally:
        assert kvray.stop(ns) >= 2
    with pytest.raises(kvray.NotStartedError):
        kvray.connect(ns)


def test_bad_config_is_one_clear_error(ray_cluster: Cluster) -> None:
    with pytest.raises(ConfigError, match="capacity='lots'"):
        kvray.start(namespace="x", capacity="lots")
    with pytest.raises(ConfigError, match="namespace"):
        kvray.start(namespace="no spaces")
    store_cfg = kvray.KVRayConfig(namespace="x")
    with pytest.raises(ConfigError, match="get_timeout_s"):
        store_cfg.replace(get_timeout_s=-1)


def test_put_rejects_bad_input(module_ns: str) -> None:
    store = kvray.connect(module_ns)
    with pytest.raises(ValueError, match="2 keys but 1 blocks"):
        store.put(_keys(2), _blocks(1))
    with pytest.raises(TypeError):
        store.put(["str-key"], _blocks(1))  # type: ignore[list-item]
    with pytest.raises(TypeError):
        store.put(_keys(1), ["not an array"])
    store.close()


@pytest.mark.slow
def test_index_restart_restores_entries_from_pools(kvray_ns: str) -> None:
    store = kvray.connect(kvray_ns)
    keys = _keys(10)
    store.put(keys, _blocks(10)).result(timeout=30)
    store.sync()
    index = ray.get_actor(index_name(kvray_ns), namespace=RAY_NAMESPACE)
    epoch = ray.get(index.current.remote())[0]
    ray.kill(index, no_restart=False)
    wait_for(
        lambda: ray.get(index.current.remote(), timeout=30)[0] != epoch, 60, "the index restart"
    )
    wait_for(lambda: (ray.get(index.locate.remote(key_ids(keys))) > 0).all(), 20, "the rebuild")
    wait_for(lambda: store.lookup(keys) == 10, 20, "the client view to resync")
    assert len(store.get(keys)) == 10
    store.close()


@pytest.mark.slow
def test_node_loss_purges_keys_and_get_raises(kvray_ns: str, ray_cluster: Cluster) -> None:
    node = ray_cluster.add_node(num_cpus=1, object_store_memory=128 << 20, resources={"node_c": 1})
    ray_cluster.wait_for_nodes()
    store = kvray.connect(kvray_ns)
    # A node that joins after start gets its pool.
    wait_for(lambda: len(store.feed.view.nodes) == 4, 30, "a pool on the new node")
    keys = _keys(5)
    _, result = ray.get(
        _put_on_node.options(resources={"node_c": 0.01}).remote(kvray_ns, keys, 5, 5)
    )
    assert result["stored"] == 5
    store.sync()
    assert store.lookup(keys) == 5
    ray_cluster.remove_node(node)
    took = wait_for(lambda: store.lookup(keys) == 0, 20, "the dead node's keys to disappear")
    assert took < 20
    with pytest.raises(kvray.BlockLostError) as info:
        store.get(keys)
    assert set(info.value.keys) == set(keys)
    store.close()


def test_prefix_by_node_counts_leading_keys_per_node(module_ns: str) -> None:
    node_a = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node_a" in n["Resources"])
    keys = _keys(6)
    ray.get(_put_on_node.options(resources={"node_a": 1}).remote(module_ns, keys[:4], 1, 4))
    store = kvray.connect(module_ns)
    try:
        store.sync()
        by_node = store.prefix_by_node(keys)
        assert by_node[node_a] == 4
        # (every other node 0; a node another test added and removed may still be listed)
        assert [n for n in by_node.values() if n] == [4] and len(by_node) >= 3
        assert store.prefix_by_node(keys[4:])[node_a] == 0
    finally:
        store.close()


def test_an_idle_feed_wakes_once_a_second_and_closes_at_once(module_ns: str) -> None:
    """A subscribed store's feed thread sleeps in its long polls (one wake a poll, about a
    second each, not ten: 4 idle stores on the 2-core box spent 46 ms/s of CPU at ten wakes a
    second, 30 at one), and ``close`` cancels the poll in flight instead of waiting it out."""
    import time

    from kvray.feed import POLL_WAIT_S

    store = kvray.connect(module_ns)
    closed = False
    try:
        assert store.feed is not None
        feed = store.feed
        store.sync()
        w0, t0 = feed.wakes, time.monotonic()
        time.sleep(3 * POLL_WAIT_S)
        woke, elapsed = feed.wakes - w0, time.monotonic() - t0
        shards = store.num_index_shards
        # Another test's namespace does not wake this one; a poll answers within POLL_WAIT_S.
        assert woke <= shards * (elapsed / POLL_WAIT_S + 2), (woke, elapsed)
        # A change answers the poll in flight; the feed polls again 10 ms later, and that
        # poll, left alone, would answer about a second after.
        keys = _keys(1, "idle-feed")
        store.put(keys, _blocks(1)).result(timeout=30)
        wait_for(lambda: store.lookup(keys) == 1, 10, "the put in the feed's view")
        time.sleep(0.1)
        t1 = time.monotonic()
        store.close()
        closed = True
        took = time.monotonic() - t1
        print(f"idle feed: {woke} wakes in {elapsed:.1f} s; close took {took * 1e3:.0f} ms")
        assert not feed._thread._thread.is_alive()
        assert took < 0.6 * POLL_WAIT_S, f"close waited for the long poll ({took:.2f} s)"
    finally:
        if not closed:
            store.close()
