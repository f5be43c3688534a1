"""Supervised background work (issue 19, item 3): every thread kvray starts is killed here by an
injected exception, and what its supervisor does is checked: logged once with its traceback,
counted (``thread_deaths``), then restarted (bounded, with backoff) or its owner closed. Also:
the pool stops its threads, ``ClientTally`` loses no count under concurrent updates, and actor
handles follow one invalidation rule (:class:`kvray.handles.HandleCache`).

Unit tests build the pool in-process (no cluster); the feed's run on the shared cluster.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

import kvray
from kvray.actors import pool as pool_module
from kvray.actors.pool import BlockPool
from kvray.disk import DiskSettings
from kvray.feed import Subscriber
from kvray.handles import HandleCache
from kvray.metrics import ClientTally, PoolMetrics
from kvray.threads import SupervisedThread, thread_deaths

MiB = 1 << 20


def _wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Injected(RuntimeError):
    """The exception the tests inject."""


# ---------------------------------------------------------------------- the supervisor itself
def test_a_dying_target_is_logged_counted_and_restarted_with_bounds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="kvray.threads")
    runs: list[float] = []
    restarted: list[BaseException] = []
    died: list[BaseException] = []

    def target() -> None:
        runs.append(time.monotonic())
        raise Injected(f"run {len(runs)}")

    before = thread_deaths().get("kvray-test-a", 0)
    t = SupervisedThread(
        target,
        "kvray-test-a",
        "a test",
        restarts=2,
        backoff_s=0.05,
        on_restart=restarted.append,
        on_death=died.append,
    ).start()
    assert t.join(5)
    assert len(runs) == 3 and t.deaths == 3  # the first run and two restarts
    assert [str(e) for e in restarted] == ["run 1", "run 2"]
    assert [str(e) for e in died] == ["run 3"]
    assert thread_deaths()["kvray-test-a"] == before + 3
    assert runs[1] - runs[0] >= 0.045 and runs[2] - runs[1] >= 0.09  # backoff, doubling
    records = [r for r in caplog.records if "kvray-test-a" in r.getMessage()]
    assert len(records) == 3 and all(r.exc_info and r.exc_info[0] is Injected for r in records)
    assert "giving up" in records[-1].getMessage()


def test_a_healthy_run_starts_the_restart_count_again() -> None:
    runs = 0

    def target() -> None:
        nonlocal runs
        runs += 1
        if runs < 5:
            raise Injected("again")

    died: list[BaseException] = []
    t = SupervisedThread(
        target, "kvray-test-b", "a test", restarts=1, backoff_s=0.01, healthy_s=0.0
    )
    t.on_death = died.append
    t.start()
    assert t.join(5)
    assert runs == 5 and t.deaths == 4 and not died


def test_a_stopped_thread_ends_and_a_failure_while_stopping_is_no_death() -> None:
    stop = threading.Event()
    exits: list[bool] = []

    def target() -> None:
        stop.wait()
        raise Injected("on the way out")

    t = SupervisedThread(
        target, "kvray-test-c", "a test", stop=stop, on_exit=lambda: exits.append(True)
    )
    t.start()
    assert t.is_alive()
    assert t.stop(5)
    assert t.deaths == 0 and exits == [True]


# ---------------------------------------------------------------------- counters
def test_client_tally_counts_exactly_under_8_threads() -> None:
    tally = ClientTally("t")
    per_thread, threads = 20_000, 8
    taken: list[dict[str, int]] = []
    done = threading.Event()

    def bump() -> None:
        for _ in range(per_thread):
            tally.add(lost=1, bytes_loaded=3)
            tally.looked_up(2, 1, 0.0)

    def take() -> None:  # the flushing thread, concurrently
        while not done.is_set():
            taken.append(tally.take()[0])

    flusher = threading.Thread(target=take)
    flusher.start()
    workers = [threading.Thread(target=bump) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    flusher.join()
    taken.append(tally.take()[0])
    n = per_thread * threads
    total = {k: sum(t[k] for t in taken) for k in ClientTally.COUNTERS}
    assert total["lost"] == n and total["bytes_loaded"] == 3 * n
    assert (total["lookups"], total["hit_blocks"], total["miss_blocks"]) == (n, 2 * n, n)


# ---------------------------------------------------------------------- handles
def test_handle_cache_resolves_once_drops_on_actor_death_backs_off_when_missing() -> None:
    calls: list[str] = []
    present = {"a": object()}

    def resolve(name: str) -> Any:
        calls.append(name)
        if name not in present:
            raise ValueError(f"no actor {name}")
        return present[name]

    cache = HandleCache(resolve=resolve, backoff_s=0.2)
    h = cache.get("a")
    assert h is present["a"] and cache.get("a") is h and calls == ["a"]
    assert not cache.failed("a", TimeoutError("slow"))  # not a death: kept
    assert cache.cached("a") is h
    assert cache.failed("a", ray.exceptions.ActorDiedError())
    assert cache.cached("a") is None
    present["a"] = object()  # recreated under the same name
    assert cache.get("a") is present["a"] and calls == ["a", "a"]
    assert cache.get("b") is None and cache.get("b") is None
    assert calls.count("b") == 1  # the second try fell in the backoff
    time.sleep(0.25)
    assert cache.get("b") is None and calls.count("b") == 2


# ---------------------------------------------------------------------- the pool's threads
class _FlakyMetrics:
    """Pool metrics whose ``used`` (set by the gauge thread only) raises once."""

    def __init__(self) -> None:
        self.raised = False

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None

    def used(self, n: int) -> None:
        if not self.raised:
            self.raised = True
            raise Injected("gauges")


class _Tripwire(deque):  # type: ignore[type-arg]
    """A queue that wakes the loop popping it and raises from ``popleft`` once."""

    def __init__(self) -> None:
        super().__init__([object()])
        self.armed = True

    def popleft(self) -> Any:
        if self.armed:
            self.armed = False
            self.clear()
            raise Injected("queue")
        return super().popleft()


@pytest.fixture
def pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    metrics = _FlakyMetrics()

    class Metrics:  # what pool.start() builds: the flaky set (no Ray metrics in-process)
        disabled = staticmethod(PoolMetrics.disabled)

        def __new__(cls, *args: object) -> Any:
            return metrics

    monkeypatch.setattr(pool_module, "PoolMetrics", Metrics)
    p = BlockPool(
        "supervision",
        "n" * 56,
        0,
        16 * MiB,
        disk=DiskSettings(str(tmp_path / "disk"), 8 * MiB),
        run=False,
    )
    yield p
    p.stop(timeout=2)


def test_pool_threads_are_restarted_counted_and_stopped_by_the_pool(pool: BlockPool) -> None:
    pool.start()
    tiering = pool._tiering
    assert tiering is not None and tiering.tier is not None
    threads = {
        "gauges": pool._gauges,
        "publish": pool._pub._thread,
        "spill": tiering._spiller,
        "disk-writer": tiering.tier._writer,
    }
    # The gauge thread dies on its first refresh; kill the other three.
    pub_resolve = pool._pub._resolve
    fired = threading.Event()

    def resolve_once() -> None:
        if not fired.is_set():
            fired.set()
            raise Injected("publisher")
        pub_resolve()

    pool._pub._resolve = resolve_once  # type: ignore[method-assign]
    with tiering._wake:
        tiering._queue = _Tripwire()
        tiering._wake.notify_all()
    book = tiering.tier._book
    with book.lock:
        book.queue = _Tripwire()
        book.wake.notify_all()
    _wait_for(lambda: all(t.deaths == 1 for t in threads.values()), 10, "four deaths")
    assert pool.stats()["thread_deaths"] == 4
    _wait_for(lambda: fired.is_set() and pool._metrics.raised, 5, "the injections")  # type: ignore[attr-defined]
    time.sleep(0.5)  # past the restart backoff
    assert all(t.is_alive() for t in threads.values()), "restarted"
    t0 = time.monotonic()
    pool.stop(timeout=2)
    for name, t in threads.items():
        assert t.join(3), f"{name} still running after the pool stopped"
    assert time.monotonic() - t0 < 3  # the gauge thread does not sleep out its 5 s
    assert pool.stats()["thread_deaths"] == 4


def test_a_disk_writer_that_keeps_dying_closes_the_tier(pool: BlockPool) -> None:
    pool.start()
    tier = pool._tiering.tier  # type: ignore[union-attr]
    assert tier is not None and tier._writer is not None
    tier._writer.restarts = 0
    with tier._lock:
        tier._book.queue = _Tripwire()
        tier._book.wake.notify_all()
    assert tier._writer.join(5)
    assert tier._writer.deaths == 1 and tier._book.closing  # spills are refused from now on


def test_every_kvray_thread_is_supervised() -> None:
    """No module starts a bare thread: only :mod:`kvray.threads` calls ``threading.Thread``."""
    root = Path(kvray.__file__).parent
    bare = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "threading.Thread(" in p.read_text() and p.name != "threads.py"
    ]
    assert not bare


# ---------------------------------------------------------------------- the feed (a cluster)
def _inject_feed_death(feed: Subscriber) -> threading.Event:
    """Make the feed loop raise once: its next poll fails and handling that failure raises."""
    poll, failed = feed._poll, feed._failed
    fired = threading.Event()

    def bad_poll(s: Any) -> Any:
        if not fired.is_set():
            fired.set()
            raise Injected("poll")
        return poll(s)

    def bad_failed(s: Any, e: BaseException, force_clear: bool = False) -> None:
        if isinstance(e, Injected):
            raise e
        failed(s, e, force_clear)

    feed._failed = bad_failed  # type: ignore[method-assign]
    feed._poll = bad_poll  # type: ignore[method-assign]
    return fired


def _filled_store(ns: str, tag: str, n: int = 8) -> tuple[kvray.Store, list[bytes]]:
    store = kvray.connect(ns)
    keys = [f"{tag}-{i}".encode() for i in range(n)]
    store.put(keys, [np.full(256, i, dtype=np.uint8) for i in range(n)]).result(30)
    store.sync()
    assert store.lookup(keys) == n
    return store, keys


@pytest.mark.slow
def test_a_dead_feed_loop_is_restarted_after_its_view_is_cleared(kvray_ns: str) -> None:
    store, keys = _filled_store(kvray_ns, "restart")
    feed = store.feed
    assert feed is not None
    seen: list[tuple[int, int]] = []
    restarting = feed._thread.on_restart
    assert restarting is not None

    def on_restart(e: BaseException) -> None:
        restarting(e)
        seen.append((len(feed.view), store.lookup(keys)))  # what lookups saw meanwhile

    feed._thread.on_restart = on_restart
    try:
        _inject_feed_death(feed).wait(10)
        _wait_for(lambda: bool(seen), 10, "the restart")
        assert seen[0] == (0, 0)  # cleared: no stale hit while the loop was down
        _wait_for(lambda: store.lookup(keys) == len(keys), 15, "the view to catch up")
        assert not store.closed and feed.thread_deaths == 1
        assert store.stats()["client"]["thread_deaths"] == 1
        more = [b"restart-after"]
        store.put(more, [np.ones(64, dtype=np.uint8)]).result(30)
        store.sync()
        assert store.lookup(more) == 1
    finally:
        store.close()


def test_a_feed_that_keeps_dying_clears_its_view_and_closes_the_store(kvray_ns: str) -> None:
    store, keys = _filled_store(kvray_ns, "dead")
    feed = store.feed
    assert feed is not None
    feed._thread.restarts = 0  # the first death is the last
    try:
        _inject_feed_death(feed).wait(10)
        _wait_for(lambda: store.closed, 10, "the store to close")
        assert feed.dead and feed.thread_deaths == 1
        assert len(feed.view) == 0 and store.lookup(keys) == 0  # misses, never stale hits
        with pytest.raises(kvray.StoreUnavailableError, match="feed thread died"):
            store.sync(timeout=2)
        with pytest.raises(kvray.StoreUnavailableError, match="feed thread died"):
            store.put([b"dead-more"], [np.ones(8, dtype=np.uint8)])
    finally:
        store.close()


def test_close_disk_and_watch_refuse_an_unbounded_wait(pool: BlockPool) -> None:
    """An infinite or NaN timeout is refused up front (every wait has a bound)."""
    from rich.console import Console

    from kvray.errors import InvalidArgumentError
    from kvray.ops.watch import watch

    for bad in (float("inf"), float("nan"), -1, True, "10"):
        with pytest.raises(InvalidArgumentError, match="close_disk: timeout"):
            pool.close_disk(timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(kvray.ConfigError, match="timeout_s="):
            watch(None, Console(), timeout_s=bad, frames=1)  # type: ignore[arg-type]
    assert pool.close_disk(timeout=0) == 0  # the tier is not started: nothing deleted


def test_a_routers_lookup_loop_stops_when_asked() -> None:
    """The router's lookup thread runs an event loop, not a loop over its stop event: asking
    it to stop (what happens before Ray shuts down) wakes the loop, and it ends at once rather
    than holding the exit for the whole bound."""
    from kvray.serving.routeview import LookupLoop

    loop = LookupLoop("test router")
    assert loop._thread.is_alive()
    assert loop._thread.stop(10.0), "still running after the bound"  # what stop_all asks too
    assert loop.deaths == 0
