"""A process that used kvray exits cleanly: kvray's threads stop before Ray's core worker goes.

Ray registers ``ray.shutdown`` with :mod:`atexit` when ``ray`` is imported, and a node's process
killer when ``ray.init`` starts a local cluster; atexit runs its hooks last-registered-first. A
kvray thread still calling Ray once the core worker is gone ends the process with status 1
("The core worker has already been shutdown ... The process will exit"), or makes Ray start a
new cluster from that thread (Ray's auto-init). So every owner of such threads (a
:class:`kvray.Store`: its feed thread, its data path's put and maintenance threads) is tracked
here from its creation, which comes after ``ray.init`` (a store joins the cluster first), and
:func:`before_ray_shutdown` is registered again at each new owner: it runs before any hook Ray
registered earlier, closes whatever is still open and stops kvray's threads nobody owns here.

A process may also shut Ray down itself (a test session's fixture: ``kvray.stop`` then
``ray.shutdown()``), long before exit: Ray then destroys its core worker under whatever kvray
thread is in a Ray call (a feed in ``ray.wait``, a data path flushing leases or metrics, an
engine's tier reporter), and the process ends with status 1 or SIGSEGV (issue 33, item 5). So
the first :func:`track` also puts :func:`before_ray_shutdown` in front of ``ray.shutdown`` (the name
callers use; Ray's own atexit hook keeps its function, after ours). Ray is imported only then.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

logger = logging.getLogger(__name__)

__all__ = ["before_ray_shutdown", "close_all", "guard_ray_shutdown", "track", "untrack"]


class Closeable(Protocol):
    def close(self) -> None: ...


#: How long :func:`before_ray_shutdown` waits for the threads of owners nobody closed (an
#: engine's tier reporter is in a Ray call of at most a few seconds).
STOP_THREADS_S = 10.0

_open: dict[int, Closeable] = {}
_lock = threading.Lock()


def track(owner: Closeable) -> None:
    """Close ``owner`` at interpreter exit, before Ray shuts down, unless closed before."""
    with _lock:
        _open[id(owner)] = owner
        # Move the hook after every hook registered so far (ray.init's among them).
        atexit.unregister(before_ray_shutdown)
        atexit.register(before_ray_shutdown)
    guard_ray_shutdown()


def guard_ray_shutdown() -> None:
    """Make ``ray.shutdown()`` call :func:`before_ray_shutdown` first (once per process)."""
    import ray

    current = ray.shutdown
    if getattr(current, "__kvray_guarded__", False):
        return
    ray.shutdown = _closing_first(current)  # type: ignore[assignment]


def _closing_first(shutdown: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(shutdown)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        before_ray_shutdown()  # kvray's threads out of Ray before its core worker goes
        return shutdown(*args, **kwargs)

    guarded.__kvray_guarded__ = True  # type: ignore[attr-defined]
    return guarded


def untrack(owner: Closeable) -> None:
    """``owner`` was closed: nothing left to do for it at exit."""
    with _lock:
        _open.pop(id(owner), None)


def before_ray_shutdown() -> None:
    """What runs before Ray shuts down (at exit, or ``ray.shutdown()``): :func:`close_all`,
    then stop every kvray thread still running, owned or not (bounded: :data:`STOP_THREADS_S`)."""
    from kvray.threads import stop_all

    close_all()
    stop_all(STOP_THREADS_S)


def close_all() -> None:
    """Close every tracked owner (newest first); errors are logged, never raised."""
    with _lock:
        owners = list(_open.values())[::-1]
    for owner in owners:
        try:
            owner.close()
        except Exception:
            logger.warning("kvray: closing %r at exit failed", owner, exc_info=True)
        untrack(owner)
