"""The engine tier: engines' own caches in kvray's index, for routing only.

Unit tests (no cluster) for the holder table, the view, the score; then a real Ray cluster and
real index shards fed by :class:`~kvray.connector.reporter.EngineReporter` with vLLM's own event
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
from kvray.meta.engine_table import (
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
    v.load_index_shard(0, np.zeros(0, np.uint64), np.zeros(0, np.uint64))  # shard 0's range gone
    assert len(v) < MAX_REPLICAS * 5000
    # A process's view counts the engine tier in its bytes (metric kvray_view_bytes).
    from kvray.meta.messages import Changes
    from kvray.meta.view import LocalView

    view = LocalView(1)
    eids = rng.integers(2, 2**63, 100_000, dtype=np.uint64)
    none = np.zeros(0, dtype=np.uint64)
    view.load(
        [
            Changes(
                index_shard=0, epoch="e", seq=1, ids=none, locs=none.astype(np.uint16),
                snapshot=True, engine_ids=eids, engine_masks=np.ones(eids.size, dtype=np.uint64),
            )
        ]
    )  # fmt: skip
    assert len(view.engine) == eids.size and view.nbytes >= 16 * eids.size


def test_a_long_poll_without_the_engine_tier_waits_past_engine_records() -> None:
    """The change log's long poll: with the engine tier, an engine record answers it; without,
    engine records are left out and waited past (the answer still reaches their seq), a CPU
    record answers at once, and a notice (health, stop) or falling behind the log ends it."""
    import asyncio

    from kvray.actors import changelog
    from kvray.actors.changelog import ChangeLog
    from kvray.meta.holders import Diff

    def cpu(i: int) -> Diff:
        return Diff(np.array([i], dtype=np.uint64), np.array([1], dtype=np.uint16))

    def eng(i: int) -> tuple[np.ndarray, np.ndarray]:
        return np.array([i], dtype=np.uint64), np.array([1], dtype=np.uint64)

    tasks: list[asyncio.Future[None]] = []

    async def later(delay: float, action: Any) -> None:
        await asyncio.sleep(delay)
        action()

    def soon(delay: float, action: Any) -> None:
        tasks.append(asyncio.ensure_future(later(delay, action)))

    async def scenario() -> None:
        log = ChangeLog()
        loop = asyncio.get_running_loop()
        # With the engine tier: the engine record answers.
        soon(0.05, lambda: log.record_engine(*eng(1)))
        t0 = loop.time()
        ids, _, eids, _, seq = await log.poll(0, 5.0)  # type: ignore[misc]
        assert loop.time() - t0 < 2.0 and eids.tolist() == [1] and ids.size == 0 and seq == 1
        # Without: engine records are waited past; the CPU record after them answers, alone.
        for i in range(3):
            soon(0.02 * (i + 1), lambda i=i: log.record_engine(*eng(i)))
        soon(0.2, lambda: log.record(cpu(7)))
        t0 = loop.time()
        ids, _, eids, _, seq = await log.poll(1, 5.0, engine=False)  # type: ignore[misc]
        took = loop.time() - t0
        assert 0.15 < took < 2.0 and ids.tolist() == [7] and eids.size == 0 and seq == log.seq
        # Only engine records: the whole wait, then an empty answer at their seq.
        soon(0.02, lambda: log.record_engine(*eng(9)))
        t0 = loop.time()
        ids, _, eids, _, seq = await log.poll(log.seq, 0.3, engine=False)  # type: ignore[misc]
        assert loop.time() - t0 >= 0.29 and ids.size == eids.size == 0 and seq == log.seq
        # A notice (a pool's health changed, a stop) answers at once; falling behind the log
        # answers None (a snapshot).
        soon(0.05, log.notify)
        t0 = loop.time()
        ids, _, eids, _, _ = await log.poll(log.seq, 5.0, engine=False)  # type: ignore[misc]
        assert loop.time() - t0 < 2.0 and ids.size == eids.size == 0
        old = changelog.MAX_LOG_ENTRIES
        changelog.MAX_LOG_ENTRIES = 2
        try:
            behind = log.seq
            soon(0.02, lambda: [log.record_engine(*eng(i)) for i in range(4)])
            assert await log.poll(behind, 5.0, engine=False) is None
        finally:
            changelog.MAX_LOG_ENTRIES = old

    asyncio.run(scenario())


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
    held = store.local_view().engine_prefix(engine_ids(hashes))
    return held[key][0] if key in held else None


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
    from kvray.connector import reporter as engine

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
    from kvray.connector.reporter import EngineReporter

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


@pytest.mark.slow
def test_a_view_without_the_engine_tier_is_neither_fed_nor_woken_by_engine_churn(
    kvray_ns: str,
) -> None:
    """A vLLM scheduler's store (``engine_view=False``, what the connector opens) keeps no
    engine rows and its long polls sleep through the engines' churn; a router's store gets
    every report; switched on later (a store shared with a router), a snapshot brings it."""
    pytest.importorskip("vllm")
    from kvray.feed import POLL_WAIT_S

    router = kvray.connect(kvray_ns)
    sched = kvray.connect(kvray_ns, engine_view=False)
    rep = _reporter(kvray_ns, "replica-churn")
    try:
        assert router.feed is not None and sched.feed is not None
        a0, b0, t0 = router.feed.answers, sched.feed.answers, time.monotonic()
        for i in range(40):  # one engine's reports, 25 ms apart: engine churn only
            rep.observe(_events(stored=_hashes(4, 100 + i)))
            assert rep.flush()
            time.sleep(0.025)
        last = _hashes(4, 139)
        _until(lambda: _engine_prefix(router, "replica-churn", last) == 4, "report", 10)
        elapsed = time.monotonic() - t0
        woke_router, woke_sched = router.feed.answers - a0, sched.feed.answers - b0
        print(
            f"{elapsed:.2f} s of churn: the router's feed woke {woke_router}x, "
            f"the scheduler's {woke_sched}x"
        )
        view = sched.local_view()
        assert len(view.engine) == 0 and view.replicas == {}
        assert woke_router >= 5  # 40 reports (answers batch those that pile up in 10 ms)
        assert woke_sched <= sched.num_index_shards * (elapsed / POLL_WAIT_S + 2)
        # The CPU tier still reaches it.
        keys = [b"churn" + h for h in last]
        sched.put(keys, np.ones((4, 64), dtype=np.uint8)).result(timeout=30)
        _until(lambda: sched.lookup(keys) == 4, "a stored block in the scheduler's view", 10)
        # Switched on: the next answers are snapshots with the engine tier. The engine's rows
        # live ENGINE_TTL_S past its last report: from here it heartbeats, as a real engine does
        # (under load the steps above can outlast the TTL, and the rows expire before the
        # snapshot could show them).
        rep._thread.start()
        sched.subscribe(engine_view=True)
        _until(lambda: _engine_prefix(sched, "replica-churn", last) == 4, "switched on", 10)
    finally:
        rep.close()
        router.close()
        sched.close()


@ray.remote(num_cpus=0)
class _Engine:
    """An engine process stand-in: a reporter fed vLLM's events, killed without a word."""

    def __init__(self, ns: str, shards: int, hashes: list[bytes]) -> None:
        from kvray.connector.reporter import EngineReporter

        self.rep = EngineReporter(ns, shards, ray.get_runtime_context().get_node_id(), "doomed")
        self.rep.observe(_events(stored=hashes))
        self.rep._thread.start()  # heartbeats, as installed in a real engine

    def ready(self) -> int:
        return self.rep.reports


@pytest.mark.slow
def test_a_killed_engines_entries_expire(kvray_ns: str) -> None:
    pytest.importorskip("vllm")
    conv = _hashes(6, 9)
    store = kvray.connect(kvray_ns)
    try:
        engine = _Engine.remote(kvray_ns, store.num_index_shards, conv)
        _until(lambda: ray.get(engine.ready.remote(), timeout=30) > 0, "first report", 30)
        _until(lambda: _engine_prefix(store, "doomed", conv) == 6, "report", 10)
        time.sleep(1.5 * ENGINE_TTL_S)  # past its TTL, alive: its heartbeats keep it
        assert _engine_prefix(store, "doomed", conv) == 6
        ray.kill(engine)
        took = _until(lambda: _engine_prefix(store, "doomed", conv) is None, "expiry", 15)
        assert len(store.local_view().engine) == 0
        print(f"killed engine's entries gone after {took:.1f} s (ttl {ENGINE_TTL_S} s)")
    finally:
        store.close()


def test_cost_estimates_ride_the_heartbeat_to_a_routers_view(kvray_ns: str) -> None:
    """Issue 32: an engine's cost estimates (a few floats) reach a router's view with its
    reports, heartbeats included; an engine without estimates (or whose estimates fail)
    reports as before, with an empty tuple."""
    pytest.importorskip("vllm")
    from kvray.meta.costs import Costs

    published = Costs(prefill_s_per_token=5e-5, step_s=0.01, queue_s=0.2, queue_reqs=1)
    rep = _reporter(kvray_ns, "replica-c")
    rep.costs = published.to_wire
    quiet = _reporter(kvray_ns, "replica-q")  # publishes nothing

    def broken() -> tuple[float, ...]:
        raise RuntimeError("no estimates")

    quiet.costs = broken
    store = kvray.connect(kvray_ns)
    try:
        assert rep.flush() and quiet.flush()  # empty reports: heartbeats
        _until(
            lambda: (
                Costs.from_wire(store.local_view().engine_costs().get("replica-c")) == published
            ),
            "costs",
            10,
        )
        _until(lambda: store.local_view().engine_costs().get("replica-q") == (), "none", 10)
        later = Costs(prefill_s_per_token=6e-5, step_s=0.01)
        rep.costs = later.to_wire
        assert rep.flush()
        _until(
            lambda: Costs.from_wire(store.local_view().engine_costs().get("replica-c")) == later,
            "a later heartbeat's costs",
            10,
        )
    finally:
        rep.close()
        quiet.close()
        store.close()
