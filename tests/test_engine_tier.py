"""The engine tier: engines' own caches in kvray's index, for routing only.

Unit tests (no cluster) for the holder table, the view, the score; then a real Ray cluster and
real index shards fed by :class:`~kvray.connector.engine.EngineReporter` with vLLM's own event
classes (the scheduler's thread is the only thing not running): a report becomes visible in
another process's view, an eviction shrinks it, a clean stop, a new incarnation and a killed
engine leave no entries, and engine entries are never a load source.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

import numpy as np
import pytest
import ray

import kvray
from kvray.meta.engine import (
    BYTES_PER_ENTRY,
    ENGINE_TTL_S,
    MAX_REPLICAS,
    EngineHolders,
    EngineView,
    prefix_by_slot,
)
from kvray.meta.ids import engine_ids, key_ids
from kvray.serving.score import Candidate, Weights, pick, split_tiers


def _hashes(n: int, seed: int) -> list[bytes]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(n)]


# ---------------------------------------------------------------- unit: table, view, score


def test_engine_ids_of_bytes_and_vllm_int_hashes_agree() -> None:
    hs = _hashes(50, 1)
    ints = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in hs]  # vLLM's int event hashes
    assert np.array_equal(engine_ids(hs), engine_ids(ints))
    assert engine_ids([]).size == 0


def test_holders_add_remove_purge_replace_report_only_changes() -> None:
    h = EngineHolders()
    ids = np.arange(10, 20, dtype=np.uint64)
    got, masks = h.add(3, ids)
    assert np.array_equal(got, ids) and (masks == 1 << 3).all()
    assert h.add(3, ids)[0].size == 0  # nothing new
    got, masks = h.add(5, ids[:4])
    assert (masks == (1 << 3 | 1 << 5)).all()
    got, masks = h.remove(3, ids[:2])
    assert np.array_equal(got, ids[:2]) and (masks == 1 << 5).all()
    got, masks = h.purge(5)
    assert dict(zip(got.tolist(), masks.tolist(), strict=True)) == {10: 0, 11: 0, 12: 8, 13: 8}
    assert len(h) == 8  # 12..19 held by slot 3 only
    got, masks = h.replace(3, ids[5:])  # 15..19: 12..14 go
    assert sorted(got[masks == 0].tolist()) == [12, 13, 14]
    assert len(h) == 5


def test_prefix_by_slot_counts_leading_blocks_per_replica() -> None:
    masks = np.array([0b111, 0b101, 0b001, 0b011], dtype=np.uint64)
    counts = prefix_by_slot(masks)
    assert counts[:3].tolist() == [4, 1, 2] and counts[3:].sum() == 0
    top = np.uint64(1) << np.uint64(MAX_REPLICAS - 1)
    assert prefix_by_slot(np.array([top, top], dtype=np.uint64))[MAX_REPLICAS - 1] == 2


def test_view_applies_records_snapshots_and_stays_in_budget() -> None:
    """64 replicas x 5,000 blocks each, no block shared: the view's bytes per entry stay
    within the stated budget (the same table holds 64 x 200k in 12.8M rows)."""
    v = EngineView(2)
    rng = np.random.default_rng(0)
    for slot in range(MAX_REPLICAS):
        ids = rng.integers(2, 2**63, 5000, dtype=np.uint64)
        v.apply(ids, np.full(ids.size, np.uint64(1) << np.uint64(slot)))
    assert len(v) == MAX_REPLICAS * 5000
    assert v.nbytes / len(v) <= BYTES_PER_ENTRY
    ids = np.array([7, 8, 9], dtype=np.uint64)
    v.apply(ids, np.array([1, 1, 1], dtype=np.uint64))
    v.apply(ids[1:], np.array([0, 3], dtype=np.uint64))  # 8 gone, 9 held by two
    assert v.masks(ids).tolist() == [1, 0, 3]
    v.load_shard(0, np.zeros(0, np.uint64), np.zeros(0, np.uint64))  # shard 0's range gone
    assert len(v) < MAX_REPLICAS * 5000


def test_score_prefers_engine_then_node_then_remote_and_yields_to_load() -> None:
    w = Weights()
    n = 10
    assert split_tiers(n, Candidate(engine=4, node_pool=6, anywhere=9)).__dict__ == {
        "engine": 4,
        "local": 2,
        "remote": 3,
        "computed": 1,
    }
    reps = ["holder", "same-node", "other-node"]
    cands = [
        Candidate(engine=10, node_pool=10, anywhere=10),
        Candidate(engine=0, node_pool=10, anywhere=10),
        Candidate(engine=0, node_pool=0, anywhere=10),
    ]
    order, reason = pick(reps, n, cands, w)
    assert order == reps and reason == "engine"
    # The holder's queue grows: three more than the same-node replica and it loses the prompt.
    busy = [Candidate(10, 10, 10, queue=3), Candidate(0, 10, 10, queue=0), cands[2]]
    order, reason = pick(reps, n, busy, w)
    assert order[0] == "same-node" and reason == "balanced"
    # A cold prompt: every score ties; power of two picks the shorter queue of two.
    cold = [Candidate(queue=q) for q in (5, 0, 5)]
    assert all(pick(reps, n, cold, w, random.Random(s))[1] == "cold" for s in range(5))
    firsts = {pick(reps, n, cold, w, random.Random(s))[0][0] for s in range(20)}
    assert "same-node" in firsts
    with pytest.raises(kvray.ConfigError, match=r"weights\.engin"):
        Weights.of({"engin": 1.0})


# ---------------------------------------------------------------- the index, real Ray


def _low64(hashes: list[bytes]) -> list[int]:
    return [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in hashes]


def _events(
    stored: list[bytes] | None = None, removed: list[bytes] | None = None, clear: bool = False
) -> list[Any]:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    out: list[Any] = []
    if clear:
        out.append(AllBlocksCleared())
    if stored:
        out.append(BlockStored(_low64(stored), None, [], 16, None, "GPU", None))
    if removed:
        out.append(BlockRemoved(_low64(removed), "GPU"))
    return out


def _engine_prefix(store: kvray.Store, key: str, hashes: list[bytes]) -> int | None:
    view = store.local_view()
    slots = {info.key: slot for slot, info in view.replicas.items()}
    if key not in slots:
        return None
    return int(view.engine.prefix_by_slot(engine_ids(hashes))[slots[key]])


def _until(cond: Any, what: str, timeout: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"{what} not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_the_reporters_queue_is_bounded_and_ends_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Events queued faster than they are sent (the reporter stuck) never pass the bound: the
    queue is dropped for one "cleared" mark (the engine's entries emptied, then rebuilt from
    what follows, never wrong); once the reporter thread has ended nothing is queued."""
    pytest.importorskip("vllm")
    from kvray.connector import engine

    monkeypatch.setattr(engine, "MAX_PENDING_BLOCKS", 100)
    rep = engine.EngineReporter("unused", 1, "node", key="stuck")  # its thread never starts
    conv = _hashes(30, 11)
    for i in range(10):  # 300 blocks stored, none sent
        rep.observe(_events(stored=conv[i * 3 : i * 3 + 3] * 10))
        assert rep._pending_blocks <= 100
    late = _hashes(5, 12)
    rep.observe(_events(stored=late))
    added, removed = rep._replay()
    # What is left: the cleared mark, then only the events after it (late's blocks among them).
    assert set(added) >= set(engine_ids(late).tolist()) and not removed
    assert rep._full and len(rep._held) < 30
    rep._thread.on_exit()  # what the supervisor calls when the thread ends for good
    rep.observe(_events(stored=_hashes(5, 13)))
    assert rep._pending == [] and rep._pending_blocks == 0 and not rep._held


def _reporter(ns: str, key: str) -> Any:
    from kvray.connector.engine import EngineReporter

    store = kvray.connect(ns)
    try:
        shards = store.num_index_shards
    finally:
        store.close()
    return EngineReporter(ns, shards, ray.get_runtime_context().get_node_id(), key=key)


def test_reports_reach_another_view_evictions_and_stops_remove_them(kvray_ns: str) -> None:
    pytest.importorskip("vllm")
    conv = _hashes(12, 7)
    rep = _reporter(kvray_ns, "replica-a")
    store = kvray.connect(kvray_ns)
    try:
        rep.observe(_events(stored=conv))
        assert rep.flush()
        _until(lambda: _engine_prefix(store, "replica-a", conv) == 12, "report", 10)
        # Engine entries are never a load source: even ids equal to the CPU tier's own keys
        # (reported here on purpose) do not make a lookup, a location or a read find them.
        keys = [b"k" + h for h in conv]
        cpu_ids = key_ids(keys)
        view = store.local_view()
        view.engine.apply(cpu_ids, np.ones(cpu_ids.size, dtype=np.uint64))
        assert store.lookup(keys) == 0
        assert view.locs(cpu_ids).tolist() == [0] * 12
        assert all(c == 0 for c in store.prefix_by_node(keys).values())
        # vLLM evicts block 5: the engine prefix ends there.
        rep.observe(_events(removed=[conv[5]]))
        assert rep.flush()
        _until(lambda: _engine_prefix(store, "replica-a", conv) == 5, "eviction", 10)
        # A new incarnation of the same replica (engine restart) starts empty.
        again = _reporter(kvray_ns, "replica-a")
        again.observe(_events(stored=conv[:2]))
        assert again.flush()
        _until(lambda: _engine_prefix(store, "replica-a", conv) == 2, "restart", 10)
        assert rep.flush() is False  # the old incarnation is refused from now on
        # A clean stop drops everything at once.
        again.close()
        _until(lambda: _engine_prefix(store, "replica-a", conv) is None, "stop", 10)
        assert len(store.local_view().engine) == 12  # only the ids injected above
    finally:
        store.close()


@ray.remote(num_cpus=0)
class _Engine:
    """An engine process stand-in: a reporter fed vLLM's events, killed without a word."""

    def __init__(self, ns: str, shards: int, hashes: list[bytes]) -> None:
        from kvray.connector.engine import EngineReporter

        self.rep = EngineReporter(ns, shards, ray.get_runtime_context().get_node_id(), "doomed")
        self.rep.observe(_events(stored=hashes))
        self.rep._thread.start()  # heartbeats, as installed in a real engine

    def ready(self) -> int:
        return self.rep.reports


def test_a_killed_engines_entries_expire(kvray_ns: str) -> None:
    pytest.importorskip("vllm")
    conv = _hashes(6, 9)
    store = kvray.connect(kvray_ns)
    try:
        engine = _Engine.remote(kvray_ns, store.num_index_shards, conv)
        _until(lambda: ray.get(engine.ready.remote(), timeout=30) > 0, "first report", 30)
        _until(lambda: _engine_prefix(store, "doomed", conv) == 6, "report", 10)
        time.sleep(2 * ENGINE_TTL_S)  # alive: its heartbeats keep it
        assert _engine_prefix(store, "doomed", conv) == 6
        ray.kill(engine)
        took = _until(lambda: _engine_prefix(store, "doomed", conv) is None, "expiry", 15)
        assert len(store.local_view().engine) == 0
        print(f"killed engine's entries gone after {took:.1f} s (ttl {ENGINE_TTL_S} s)")
    finally:
        store.close()
