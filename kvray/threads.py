"""Supervised background threads: every thread kvray starts has an owner, a stop and a supervisor.

A :class:`SupervisedThread` runs its ``target`` (a loop that returns when its owner stops it).
If the target raises, the supervisor, on the same thread:

1. logs the exception once, with its traceback, naming the thread and its owner;
2. counts it (:attr:`SupervisedThread.deaths`, exposed in the owner's stats as
   ``thread_deaths``, and :func:`thread_deaths` for the whole process);
3. restarts the target after a backoff (``backoff_s`` doubling up to ``max_backoff_s``),
   calling ``on_restart`` first (the owner resets what the dead loop may have left half done),
   at most ``restarts`` times in a row (a target that ran ``healthy_s`` before dying starts
   the count again); after that, or with ``restarts=0``, it calls ``on_death`` (the owner
   closes itself or marks itself broken) and the thread ends.

A target that returns ends the thread (its owner stopped it, or its work is done); so does
any exception once ``stop`` is set (the owner is closing: nothing to restart, not counted).
``on_exit`` runs once when the thread finally ends, whatever the way.

:func:`stop_all` stops every supervised thread of the process that still runs (the threads of
owners nobody closed: an engine's tier reporter, a router's lookup loop), bounded: what
:func:`kvray.shutdown.before_ray_shutdown` does last. Ray-free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["SupervisedThread", "stop_all", "thread_deaths"]

_deaths: Counter[str] = Counter()
_deaths_lock = threading.Lock()
#: Supervised threads started and not yet ended.
_live: set[SupervisedThread] = set()
_live_lock = threading.Lock()


def stop_all(timeout: float) -> list[str]:
    """Set the stop of every running supervised thread, then wait for them, ``timeout`` s in
    all; the names of those still running after it (each logged)."""
    with _live_lock:
        threads = list(_live)
    for t in threads:
        t.request_stop()
    deadline = time.monotonic() + timeout
    left = [t for t in threads if not t.join(max(0.0, deadline - time.monotonic()))]
    for t in left:
        logger.warning("kvray: thread %s of %s still runs after %.0f s", t.name, t.owner, timeout)
    return [t.name for t in left]


def thread_deaths() -> dict[str, int]:
    """Deaths of supervised threads in this process so far, by thread name."""
    with _deaths_lock:
        return dict(_deaths)


class SupervisedThread:
    """One supervised daemon thread (see the module docstring)."""

    def __init__(
        self,
        target: Callable[[], None],
        name: str,
        owner: str,
        *,
        stop: threading.Event | None = None,
        restarts: int = 3,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        healthy_s: float = 60.0,
        on_restart: Callable[[BaseException], None] | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        on_exit: Callable[[], None] | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        if restarts < 0:
            raise ValueError(f"SupervisedThread: restarts must be >= 0, got {restarts}")
        self.name = name
        self.owner = owner
        self.stopping = stop if stop is not None else threading.Event()
        self.restarts = restarts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.healthy_s = healthy_s
        self.on_restart = on_restart
        self.on_death = on_death
        self.on_exit = on_exit
        #: Called (from the stopping thread) after the stop is set, for a target that waits on
        #: something else than :attr:`stopping` (an event loop's ``run_forever``).
        self.wake = wake
        #: Times the target raised.
        self.deaths = 0
        #: The last exception the target raised.
        self.error: BaseException | None = None
        self._target = target
        self._thread = threading.Thread(target=self._supervise, name=name, daemon=True)

    # ------------------------------------------------------------------ owner's side
    def start(self) -> SupervisedThread:
        with _live_lock:
            _live.add(self)
        try:
            self._thread.start()
        except BaseException:
            with _live_lock:
                _live.discard(self)
            raise
        return self

    def stop(self, timeout: float | None = 5.0) -> bool:
        """Set the stop event and wait up to ``timeout`` s for the thread to end; True if it
        did (or never started). The target must watch :attr:`stopping` (or its owner's own
        stop, passed as ``stop``)."""
        self.request_stop()
        return self.join(timeout)

    def request_stop(self) -> None:
        """Set the stop event (and wake the target, if it said how); does not wait."""
        self.stopping.set()
        if self.wake is not None:
            try:
                self.wake()
            except Exception:  # a loop already closed: nothing left to wake
                logger.debug("kvray: waking %s of %s failed", self.name, self.owner, exc_info=True)

    def join(self, timeout: float | None = None) -> bool:
        t = self._thread
        if t.ident is not None and t is not threading.current_thread():
            t.join(timeout)
        return not t.is_alive()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ the thread
    def _supervise(self) -> None:
        in_a_row = 0
        try:
            while True:
                began = time.monotonic()
                try:
                    self._target()
                    return
                except Exception as e:
                    error: BaseException = e
                if self.stopping.is_set():  # its owner is closing: not a death
                    logger.debug(
                        "kvray: %s of %s failed while stopping: %r", self.name, self.owner, error
                    )
                    return
                self.error = error
                self.deaths += 1
                with _deaths_lock:
                    _deaths[self.name] += 1
                in_a_row = 1 if time.monotonic() - began >= self.healthy_s else in_a_row + 1
                last = in_a_row > self.restarts
                logger.error(
                    "kvray: thread %s of %s died (%d time(s)); %s",
                    self.name,
                    self.owner,
                    self.deaths,
                    "giving up" if last else f"restarting ({in_a_row}/{self.restarts})",
                    exc_info=error,
                )
                hook = self.on_death if last else self.on_restart
                if hook is not None:
                    self._call(hook, error)
                if last:
                    return
                backoff = min(self.max_backoff_s, self.backoff_s * 2 ** (in_a_row - 1))
                if self.stopping.wait(backoff):
                    return
        finally:
            if self.on_exit is not None:
                self._call(self.on_exit)
            with _live_lock:
                _live.discard(self)

    def _call(self, hook: Callable[..., None], *args: object) -> None:
        try:
            hook(*args)
        except Exception:
            logger.exception("kvray: the supervisor hook of %s (%s) failed", self.name, self.owner)
