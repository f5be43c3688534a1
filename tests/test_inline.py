"""Small puts and reads go by value inside the call (issue 35, item 4): bytes, counters,
leases and corruption through the public API, on the session cluster (head + nodes A and B).

A segment or a read of at most ``INLINE_BYTES`` travels in the actor call itself instead of
through the object store (no ``ray.put`` and owner lookup on either side). What must not change:
the bytes, the checksums checked on every read, the pool's counters (each served byte counted
once), and no lease left behind.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
import ray
from store_helpers import corrupt_in_plasma, wait_for

import kvray
from kvray.meta.ids import key_ids
from kvray.meta.messages import INLINE_BYTES, RAY_NAMESPACE, pool_name
from kvray.meta.segment import SegmentMeta

SMALL = 4 << 10  # 24 of them: 96 KiB, the request


def _keys(n: int) -> list[bytes]:
    salt = uuid.uuid4().hex.encode()
    return [salt + i.to_bytes(4, "big") for i in range(n)]


def _blocks(n: int, nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 255, (n, nbytes), dtype=np.uint8)


def _pool(ns: str, node: str | None = None) -> Any:
    node = node or ray.get_runtime_context().get_node_id()
    return ray.get_actor(pool_name(ns, node), namespace=RAY_NAMESPACE)


def _stats(pool: Any) -> dict[str, int]:
    return ray.get(pool.stats.remote(), timeout=30)


def test_a_small_read_comes_back_by_value_counted_once_and_unleased(module_ns: str) -> None:
    store = kvray.connect(module_ns)
    pool = _pool(module_ns)
    keys, blocks = _keys(24), _blocks(24, SMALL)
    heap = _stats(pool)["heap_bytes"]
    assert store.put(keys, blocks).result(timeout=30).stored == 24
    assert _stats(pool)["heap_bytes"] == heap + 24 * SMALL  # kept in the pool's own memory
    store.sync()
    before = _stats(pool)
    got = store.get(keys)
    assert [g.tobytes() for g in got] == [b.tobytes() for b in blocks]
    after = _stats(pool)
    assert after["inlined_bytes"] - before["inlined_bytes"] == 24 * SMALL
    assert after["served_bytes"] - before["served_bytes"] == 24 * SMALL
    assert after["active_leases"] <= before["active_leases"]  # it took no lease
    assert after["sliced_bytes"] == before["sliced_bytes"]
    # A read of more than INLINE_BYTES is leased and mapped as before, bytes equal.
    big_keys = _keys(INLINE_BYTES // SMALL + 1)
    big = _blocks(len(big_keys), SMALL, seed=1)
    store.put(big_keys, big).result(timeout=30)
    store.sync()
    before = _stats(pool)
    assert [g.tobytes() for g in store.get(big_keys)] == [b.tobytes() for b in big]
    after = _stats(pool)
    assert after["inlined_bytes"] == before["inlined_bytes"]
    wait_for(
        lambda: _stats(pool)["served_bytes"] - before["served_bytes"] == big.nbytes,
        10,
        "the leased read's bytes to be counted",
    )
    store.close()


def test_a_small_read_from_another_node_comes_by_value(module_ns: str) -> None:
    @ray.remote(num_cpus=0, resources={"node_a": 0.01})
    def put_on_a(ns: str, keys: list[bytes], blocks: np.ndarray) -> str:
        s = kvray.connect(ns)
        try:
            assert s.put(keys, blocks).result(timeout=30).stored == len(keys)
            return ray.get_runtime_context().get_node_id()
        finally:
            s.close()

    @ray.remote(num_cpus=0, resources={"node_b": 0.01})
    def get_on_b(ns: str, keys: list[bytes]) -> list[bytes]:
        s = kvray.connect(ns)
        try:
            s.sync()
            return [g.tobytes() for g in s.get(keys)]
        finally:
            s.close()

    keys, blocks = _keys(6), _blocks(6, SMALL, seed=2)
    node_a = ray.get(put_on_a.remote(module_ns, keys, blocks), timeout=60)
    pool = _pool(module_ns, node_a)
    before = _stats(pool)
    got = ray.get(get_on_b.remote(module_ns, keys[1:4]), timeout=60)
    assert got == [b.tobytes() for b in blocks[1:4]]
    after = _stats(pool)
    assert after["inlined_bytes"] - before["inlined_bytes"] == 3 * SMALL
    assert after["sliced_bytes"] == before["sliced_bytes"]  # no fresh object was needed
    assert after["active_leases"] == 0


def test_a_corrupt_block_read_by_value_is_reported_and_never_served(module_ns: str) -> None:
    store = kvray.connect(module_ns)
    pool = _pool(module_ns)
    keys, blocks = _keys(3), _blocks(3, SMALL, seed=3)
    store.put(keys, blocks).result(timeout=30)
    store.sync()
    corrupt_in_plasma(pool, keys[1])  # in the pool's own object (a bad DIMM)
    before = _stats(pool)
    with pytest.raises(kvray.BlockLostError) as info:
        store.get(keys)
    assert info.value.keys == [keys[1]]
    assert "checksum" in info.value.reason
    assert _stats(pool)["inlined_bytes"] > before["inlined_bytes"]  # the read went by value
    wait_for(lambda: store.lookup(keys) == 1, 10, "the corrupt block to leave the index")
    assert [g.tobytes() for g in store.get(keys[:1])] == [blocks[0].tobytes()]
    assert _stats(pool)["lost"] == before["lost"] + 1
    store.close()


@pytest.mark.parametrize("form", ["array", "list"])
def test_the_pool_takes_a_segment_sent_by_value(module_ns: str, form: str) -> None:
    """``put_segment`` with the blocks themselves (what a small put sends) stores them as its
    own object: a lease maps them, bytes equal; blocks of the wrong size are refused."""
    kvray.connect(module_ns).close()
    pool = _pool(module_ns)
    keys, blocks = _keys(4), _blocks(4, SMALL, seed=4)
    payload: Any = blocks if form == "array" else [b for b in blocks]
    ids = key_ids(keys)

    def wire(keys: list[bytes], ids: np.ndarray) -> bytes:
        n = len(keys)
        sizes = np.full(n, SMALL, np.int64)
        zeros = np.zeros(n, np.uint64)  # checksums: not checked by the pool
        return SegmentMeta.from_keys(
            keys, ids, np.zeros(n, np.uint16), np.ones(n, np.uint16), sizes, zeros
        ).to_wire()

    heap_before = _stats(pool)["heap_bytes"]
    result = ray.get(pool.put_segment.remote(wire(keys, ids), [payload]), timeout=30)
    assert result.stored == 4
    # Sent by value, kept in the pool's own memory: no object store round trip on the put.
    assert _stats(pool)["heap_bytes"] == heap_before + 4 * SMALL
    # A read that is not answered by value (inline=0) still gets an object to map: made on
    # demand, kept for later readers, and the heap copy goes.
    lease = ray.get(pool.lease.remote(keys, ids, 0), timeout=30)
    assert all(isinstance(r, ray.ObjectRef) for r in lease.segments.values())
    (seg,) = ray.get(list(lease.segments.values()))
    assert [seg[p].tobytes() for p in lease.positions.tolist()] == [b.tobytes() for b in blocks]
    assert _stats(pool)["heap_bytes"] == heap_before
    again = ray.get(pool.lease.remote(keys, ids, 0), timeout=30)
    assert list(again.segments.values()) == list(lease.segments.values())  # the same object
    ray.get(pool.release.remote(lease.lease_id), timeout=30)
    ray.get(pool.release.remote(again.lease_id), timeout=30)
    # Blocks that do not match their declared sizes are refused, counted, never stored.
    wrong = [b[:100] for b in blocks] if form == "list" else blocks[:, :100]
    other = _keys(4)
    refused = ray.get(pool.put_segment.remote(wire(other, key_ids(other)), [wrong]), timeout=30)
    assert (refused.stored, refused.refused) == (0, 4)
    assert _stats(pool)["heap_bytes"] == heap_before
    missing = ray.get(pool.lease.remote(other, key_ids(other), 0), timeout=30)
    assert missing.num_found == 0


def test_a_small_put_its_pool_does_not_answer_is_refused_in_time(module_ns: str) -> None:
    """A small put is sent from the caller's thread, not the put threads; its bound still
    holds: a pool that does not answer (its lock held here) has the put refused, counted,
    within ``put_timeout_s`` and the maintenance thread's tick, and the store stays usable."""
    import time

    from kvray.config import KVRayConfig

    store = kvray.connect(module_ns, KVRayConfig(namespace=module_ns, put_timeout_s=1.0))
    pool = _pool(module_ns)
    held = pool.__ray_call__.remote(
        lambda self: self._lock.acquire() and (time.sleep(6.0), self._lock.release())
    )
    wait_for(
        lambda: ray.get(pool.__ray_call__.remote(lambda self: self._lock.locked()), timeout=30),
        10,
        "the pool's lock to be taken",
    )
    keys, blocks = _keys(4), _blocks(4, SMALL, seed=8)
    t0 = time.monotonic()
    fut = store.put(keys, blocks)
    result = fut.result(timeout=10)
    elapsed = time.monotonic() - t0
    assert (result.stored, result.refused) == (0, 4), result
    assert elapsed < 3.5, elapsed  # 1 s bound + a 1 s tick, well before the lock goes
    ray.get(held, timeout=30)
    again = _keys(4)
    assert store.put(again, blocks).result(timeout=30).stored == 4
    store.close()


def test_close_waits_for_small_puts_in_flight(module_ns: str) -> None:
    store = kvray.connect(module_ns)
    futures = [store.put(_keys(4), _blocks(4, SMALL, seed=s)) for s in range(8)]
    store.close()
    assert all(f.done() for f in futures)
    assert sum(f.result().stored for f in futures) == 32


def test_the_heap_budget_is_bounded_and_given_back() -> None:
    """A pool keeps at most its budget of small segments in its own memory (what does not
    fit goes to the object store), on copies of what it was sent; a segment's bytes come
    back to the budget when the pool lets go of it."""
    from kvray.actors.heap import HeapBudget

    budget = HeapBudget(limit=3 * SMALL)
    sent = _blocks(2, SMALL)
    a = budget.hold(sent, 2 * SMALL)
    assert a is not None and budget.used == 2 * SMALL
    assert not np.shares_memory(a.payload, sent)
    assert budget.hold(sent, 2 * SMALL) is None  # over the limit
    b = budget.hold([sent[0]], SMALL)
    assert b is not None and budget.used == 3 * SMALL
    del a
    assert budget.used == SMALL
    del b
    assert budget.used == 0
