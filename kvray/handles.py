"""Named actor handles, cached one way: resolved by name once, dropped when a call says the actor
died or is unavailable, resolved again on next use (with backoff while the name is missing).

Used by every client of a named actor outside the control plane: the data path to the pools
(:mod:`kvray.blockio`), a pool's stream to the index shards (:mod:`kvray.actors.publisher`)
and the change feed (:mod:`kvray.feed`). Resolving is a GCS round trip: :meth:`HandleCache.get`
may make one, so call it outside any lock and off any event loop; :meth:`HandleCache.cached`
never does (for paths under a lock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import ray

from kvray.meta.messages import RAY_NAMESPACE

if TYPE_CHECKING:
    from typing import TypeAlias

    from ray.actor import ActorHandle

    from kvray.actors.index import IndexShard
    from kvray.actors.pool import BlockPool
    from kvray.actors.reconciler import Reconciler

    #: Handles of kvray's actors, by the class each runs (annotations only: importing this
    #: module loads no actor code).
    IndexHandle: TypeAlias = ActorHandle[IndexShard]
    PoolHandle: TypeAlias = ActorHandle[BlockPool]
    ControlHandle: TypeAlias = ActorHandle[Reconciler]

__all__ = ["HandleCache", "is_gone"]

#: The actor class whose handles a cache holds.
A = TypeVar("A")


def is_gone(error: BaseException) -> bool:
    """The invalidation rule: a call failed because the actor died or is unavailable
    (``ActorDiedError``, ``ActorUnavailableError``); any other error keeps the handle."""
    return isinstance(error, ray.exceptions.RayActorError)


def _resolve(name: str) -> ActorHandle[Any]:  # Ray's get_actor does not know the class
    return ray.get_actor(name, namespace=RAY_NAMESPACE)


class HandleCache(Generic[A]):
    """Actor handles by name (thread-safe); ``HandleCache[IndexShard]``: of index shards."""

    def __init__(
        self,
        *,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        resolve: Callable[[str], ActorHandle[A]] = _resolve,
    ) -> None:
        self._resolve = resolve
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self._handles: dict[str, ActorHandle[A]] = {}
        self._misses: dict[str, tuple[int, float]] = {}  # name -> (failed resolves, retry at)
        #: Handles dropped by :meth:`failed` so far.
        self.dropped = 0

    def cached(self, name: str) -> ActorHandle[A] | None:
        """The handle if it is cached; never a GCS call (safe under a lock)."""
        with self._lock:
            return self._handles.get(name)

    def get(self, name: str) -> ActorHandle[A] | None:
        """The handle, resolving it if not cached; None when no actor has that name (or the
        last try was less than a backoff ago). May make a GCS call."""
        with self._lock:
            h = self._handles.get(name)
            if h is not None:
                return h
            miss = self._misses.get(name)
            if miss is not None and time.monotonic() < miss[1]:
                return None
        try:
            h = self._resolve(name)
        except ValueError:  # no such actor (yet)
            with self._lock:
                n = self._misses.get(name, (0, 0.0))[0] + 1
                wait = min(self._max_backoff_s, self._backoff_s * 2 ** (n - 1))
                self._misses[name] = (n, time.monotonic() + wait)
            return None
        with self._lock:
            self._misses.pop(name, None)
            return self._handles.setdefault(name, h)

    def put(self, name: str, handle: ActorHandle[A]) -> None:
        """Seed the cache with a handle resolved elsewhere."""
        with self._lock:
            self._handles[name] = handle
            self._misses.pop(name, None)

    def failed(self, name: str, error: BaseException, handle: ActorHandle[A] | None = None) -> bool:
        """A call through ``name``'s handle raised ``error``: drop the handle if the actor is
        gone (only if it is still ``handle``, when given). True when dropped (or gone)."""
        if not is_gone(error):
            return False
        with self._lock:
            h = self._handles.get(name)
            if h is not None and (handle is None or h is handle):
                del self._handles[name]
                self.dropped += 1
        return True

    def clear(self) -> None:
        with self._lock:
            self._handles.clear()
            self._misses.clear()
