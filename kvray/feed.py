"""Keeping a :class:`LocalView` fresh: one thread long-polls every index shard.

Only processes that answer lookups subscribe (a vLLM scheduler, a router, a driver); a vLLM
worker gets block locations in the connector metadata and runs no feed. With ``k`` index shards
the thread keeps one long poll in flight per shard and applies whichever answers first.

Failures: a shard that is gone for good (``kvray.stop``, or killed) or keeps failing has its part
of the view cleared at once, so lookups stop reporting blocks nobody may hold, and the thread
looks the shard up again by name with backoff (kvray may be started again; one
:class:`~kvray.handles.HandleCache`); each transition is logged once. A shard that answers
``stopped`` ends the subscription.

The thread itself is supervised (:class:`~kvray.threads.SupervisedThread`): should its loop
raise, the whole view is cleared first (lookups miss, never serve what the dead loop last saw)
and the loop restarts from fresh snapshots, up to :data:`RESTARTS` times in a row with backoff.
Past that the feed is dead: the view stays empty, :attr:`Subscriber.closed` is set (so is
``Store.closed``), lookups miss and ``sync`` raises, naming the error. Deaths are counted
(:attr:`Subscriber.thread_deaths`, ``thread_deaths`` in ``Store.stats()["client"]``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import ray
from ray import ObjectRef

from kvray.errors import StoreUnavailableError
from kvray.handles import HandleCache
from kvray.meta.idtable import warm_up
from kvray.meta.messages import Changes, index_name
from kvray.meta.view import LocalView
from kvray.threads import SupervisedThread

if TYPE_CHECKING:
    from kvray.actors.index import IndexShard
    from kvray.handles import IndexHandle

logger = logging.getLogger(__name__)

__all__ = ["Subscriber"]

#: How long a long poll waits for a change before answering empty.
POLL_WAIT_S = 1.0
#: Longest the feed thread blocks in one ``ray.wait`` on its polls when none is due: a long
#: poll answers within :data:`POLL_WAIT_S`, so an idle feed wakes about once a second, not ten
#: times (4 idle subscribed stores on the 2-core box: 30 ms/s of CPU in all against 46 at ten
#: wakes a second). ``close`` does not wait for it: it cancels the polls in flight
#: (:meth:`_cancel_polls`).
WAIT_SLICE_S = POLL_WAIT_S + 0.5
#: Least time between two polls of one shard: under a stream of changes each answer carries
#: what piled up meanwhile, instead of one poll round trip per pool batch (8 subscribers
#: polling 2 shards back to back cost more CPU than the index applying the changes).
POLL_MIN_INTERVAL_S = 0.01
#: Consecutive failures of one shard before its part of the view is cleared.
CLEAR_AFTER_FAILURES = 3
#: Restarts in a row of a feed thread whose loop raised before the feed is declared dead.
RESTARTS = 3


class _Shard:
    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.name = name
        self.failures = 0
        self.retry_at = 0.0
        self.next_poll = 0.0
        self.cleared = False
        #: Whether the poll in flight asked for the engine tier.
        self.asked_engine = False


class Subscriber:
    """The change feeds of one namespace, applied to a view from a background thread."""

    def __init__(
        self,
        namespace: str,
        handles: list[IndexHandle],
        get_timeout_s: float,
        *,
        engine_view: bool = True,
    ) -> None:
        """``engine_view``: the view also keeps the engine tier (routers read it; a vLLM
        scheduler, which only looks up loadable blocks, does not: its feed then carries
        none of the engines' cache churn and is not woken by it)."""
        self.namespace = namespace
        self.engine_view = engine_view
        #: Shards whose next answer must be a snapshot (the engine tier was switched on).
        self._resnap: set[int] = set()
        #: Answers applied.
        self.answers = 0
        #: Times the feed thread woke from waiting (for an answer, or for a shard to be due).
        self.wakes = 0
        self.view = LocalView(len(handles))
        self._shards = [_Shard(i, index_name(namespace, i)) for i in range(len(handles))]
        self._handles: HandleCache[IndexShard] = HandleCache()
        for s, h in zip(self._shards, handles, strict=True):
            self._handles.put(s.name, h)
        self._timeout = get_timeout_s
        self._cv = threading.Condition()
        self._closed = threading.Event()
        self.stopped = False
        #: The loop died more than :data:`RESTARTS` times in a row: the view stays empty.
        self.dead = False
        self.error: str | None = None
        self._thread = SupervisedThread(
            self._run,
            "kvray-feed",
            f"the feed of namespace {namespace!r}",
            stop=self._closed,
            restarts=RESTARTS,
            backoff_s=0.5,
            on_restart=self._restarting,
            on_death=self._died,
            wake=self._cancel_polls,
        )
        #: The feed thread's long polls in flight and their shards. Only that thread changes it,
        #: under the lock, so ``close`` can take the refs to cancel.
        self._pending: dict[ObjectRef[Changes], _Shard] = {}
        self._pending_lock = threading.Lock()

    def start(self) -> None:
        """Take a first snapshot of every shard (so lookups work at once), then subscribe."""
        warm_up()  # numba's import and kernel loads now, not in the first request's lookup
        refs = [
            self._handle(s).changes.remote(self.view.epochs[s.index], -1, 0.0, self.engine_view)
            for s in self._shards
        ]
        snapshots: list[Changes] = ray.get(refs, timeout=self._timeout)
        if any(ch.stopped for ch in snapshots):
            raise StoreUnavailableError(f"kvray: namespace {self.namespace!r} is being stopped")
        with self._cv:
            self.view.load(snapshots)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def thread_deaths(self) -> int:
        return self._thread.deaths

    def close(self) -> None:
        # The stop cancels the long polls in flight (the thread's ray.wait returns at once);
        # a poll that cannot be cancelled (its shard is gone) still answers within about a
        # second. Ray must not shut down under them.
        self._thread.stop(timeout=POLL_WAIT_S + self._timeout + 2)

    def _cancel_polls(self) -> None:
        """Cancel the long polls in flight (the stop is set: the feed thread then returns)."""
        with self._pending_lock:
            refs = list(self._pending)
        for ref in refs:
            try:
                ray.cancel(ref)
            except Exception:  # Ray shut down, or the poll already answered
                logger.debug("kvray feed: cancelling a long poll failed", exc_info=True)

    # ------------------------------------------------------------------ supervision
    def _clear_all(self) -> None:
        """Forget every shard (on the feed thread: the view keeps one writer)."""
        with self._cv:
            for s in self._shards:
                self.view.clear_index_shard(s.index)
                s.cleared, s.failures, s.retry_at, s.next_poll = True, 0, 0.0, 0.0
            self._cv.notify_all()

    def _restarting(self, e: BaseException) -> None:
        self.error = f"the feed thread restarted after {type(e).__name__}: {e}"
        self._clear_all()  # the new loop starts from snapshots: nothing stale meanwhile

    def _died(self, e: BaseException) -> None:
        self.error = f"the feed thread died: {type(e).__name__}: {e}"
        self.dead = True
        self._clear_all()
        self._closed.set()  # the store is closed: lookups miss, sync and puts say why
        with self._cv:
            self._cv.notify_all()

    # ------------------------------------------------------------------ the thread
    def _handle(self, s: _Shard) -> IndexHandle:
        h = self._handles.get(s.name)
        if h is None:
            raise StoreUnavailableError(f"kvray: index shard {s.name} is not running")
        return h

    def include_engine_tier(self) -> None:
        """Keep the engine tier from now on (a store without it, shared with a router): the
        next answer of every shard is a snapshot with it."""
        with self._cv:
            if not self.engine_view:
                self.engine_view = True
                self._resnap = set(range(len(self._shards)))

    def _poll(self, s: _Shard) -> ObjectRef[Changes]:
        v = self.view
        with self._cv:
            engine, epoch = self.engine_view, v.epochs[s.index]
            if s.index in self._resnap:
                epoch = ""  # not the shard's epoch: it answers a snapshot
        s.asked_engine = engine
        return self._handle(s).changes.remote(epoch, v.seqs[s.index], POLL_WAIT_S, engine)

    def _run(self) -> None:
        pending = self._pending
        issued: dict[int, float] = {}
        with self._pending_lock:  # a restarted loop: the last one's polls are abandoned
            pending.clear()
        while not self._closed.is_set():
            if not ray.is_initialized():  # shut down under us: a Ray call would start a new one
                return
            now = time.monotonic()
            for s in self._shards:
                if s.index not in issued and now >= max(s.retry_at, s.next_poll):
                    try:
                        ref = self._poll(s)
                    except Exception as e:
                        self._failed(s, e)
                        continue
                    with self._pending_lock:
                        pending[ref] = s
                    issued[s.index] = now
                    if self._closed.is_set():  # closed while this poll was issued
                        self._cancel_polls()
            # Wake for an answer, or when the next shard is due to be polled again.
            due = [max(s.retry_at, s.next_poll) for s in self._shards if s.index not in issued]
            timeout = max(0.0, min(due) - time.monotonic()) if due else POLL_WAIT_S
            if pending:
                try:
                    ready, _ = ray.wait(
                        list(pending), num_returns=1, timeout=min(timeout, WAIT_SLICE_S)
                    )
                except Exception:
                    if self._closed.is_set() or not ray.is_initialized():
                        return
                    raise
            else:
                ready = []
                self._closed.wait(timeout)
            self.wakes += 1
            if self._closed.is_set():
                return
            for ref in ready:
                with self._pending_lock:
                    s = pending.pop(ref)
                s.next_poll = issued.pop(s.index) + POLL_MIN_INTERVAL_S
                try:
                    ch: Changes = ray.get(ref, timeout=self._timeout)
                except (SystemExit, KeyboardInterrupt):
                    return
                except Exception as e:
                    if self._closed.is_set() or not ray.is_initialized():
                        return
                    self._failed(s, e)
                    continue
                try:
                    self._apply(s, ch)
                except Exception as e:  # never leave a half-applied view: start over
                    logger.exception(
                        "kvray feed: applying index shard %d's changes failed", s.index
                    )
                    self._failed(s, e, force_clear=True)
                if self.stopped:
                    self._closed.set()
                    return
            # A poll that outlived its wait by get_timeout_s is presumed lost.
            for ref, s in list(pending.items()):
                if time.monotonic() - issued[s.index] > POLL_WAIT_S + self._timeout:
                    with self._pending_lock:
                        del pending[ref]
                    del issued[s.index]
                    self._failed(s, TimeoutError("long poll did not answer"))

    def _apply(self, s: _Shard, ch: Changes) -> None:
        if ch.stopped:
            logger.info("kvray: namespace %r was stopped; view cleared", self.namespace)
            self.stopped = True
            self.error = "kvray was stopped in this namespace"
            with self._cv:
                for shard in self._shards:
                    self.view.clear_index_shard(shard.index)
                self._cv.notify_all()
            return
        with self._cv:
            self.view.apply(ch)
            self.answers += 1
            if ch.snapshot and s.asked_engine:
                self._resnap.discard(s.index)
            self._cv.notify_all()
        if s.failures or s.cleared:
            logger.info("kvray: index shard %d of %r answers again", s.index, self.namespace)
        s.failures, s.cleared, self.error = 0, False, None

    def _failed(self, s: _Shard, e: BaseException, force_clear: bool = False) -> None:
        s.failures += 1
        self.error = f"index shard {s.index}: {type(e).__name__}: {e}"
        self._handles.failed(s.name, e)  # looked up again by name at the next poll
        gone = isinstance(e, ray.exceptions.ActorDiedError)
        if (force_clear or gone or s.failures >= CLEAR_AFTER_FAILURES) and not s.cleared:
            logger.warning(
                "kvray: index shard %d of %r unreachable (%s); its part of the view is "
                "cleared until it answers again",
                s.index,
                self.namespace,
                self.error,
            )
            with self._cv:
                self.view.clear_index_shard(s.index)
                self._cv.notify_all()
            s.cleared = True
        s.retry_at = time.monotonic() + min(2.0, 0.1 * 2 ** min(s.failures, 5))

    # ------------------------------------------------------------------ barrier
    def sync(self, timeout: float) -> None:
        """Wait until the view reflects every block any pool had stored when called."""
        if self._closed.is_set():
            raise StoreUnavailableError(
                f"kvray: the store of namespace {self.namespace!r} is closed"
                + (f" ({self.error})" if self.stopped or self.dead else "")
            )
        deadline = time.monotonic() + timeout
        try:
            refs = [self._handle(s).barrier.remote(timeout, self.engine_view) for s in self._shards]
            marks = ray.get(refs, timeout=timeout + 5)
        except Exception as e:
            for s in self._shards:
                self._handles.failed(s.name, e)
            raise StoreUnavailableError(f"kvray: the index did not answer a barrier: {e}") from e
        v = self.view
        with self._cv:
            for i, (epoch, seq) in enumerate(marks):
                while not (v.epochs[i] == epoch and v.seqs[i] >= seq):
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed.is_set():
                        raise StoreUnavailableError(
                            "kvray: the local view did not catch up with the index in time"
                            + (f" ({self.error})" if self.error else "")
                        )
                    self._cv.wait(min(left, 0.5))
