"""A process that used kvray exits cleanly: kvray's threads stop before Ray's core worker goes.

Ray registers ``ray.shutdown`` with :mod:`atexit` when ``ray`` is imported, and a node's process
killer when ``ray.init`` starts a local cluster; atexit runs its hooks last-registered-first. A
kvray thread still calling Ray once the core worker is gone ends the process with status 1
("The core worker has already been shutdown ... The process will exit"), or makes Ray start a
new cluster from that thread (Ray's auto-init). So every owner of such threads (a
:class:`kvray.Store`: its feed thread, its data path's put and maintenance threads) is tracked
here from its creation, which comes after ``ray.init`` (a store joins the cluster first), and
:func:`close_all` is registered again at each new owner: it runs before any hook Ray registered
earlier, and closes whatever is still open. Ray-free.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Protocol

logger = logging.getLogger(__name__)

__all__ = ["close_all", "track", "untrack"]


class Closeable(Protocol):
    def close(self) -> None: ...


_open: dict[int, Closeable] = {}
_lock = threading.Lock()


def track(owner: Closeable) -> None:
    """Close ``owner`` at interpreter exit, before Ray shuts down, unless closed before."""
    with _lock:
        _open[id(owner)] = owner
        # Move the hook after every hook registered so far (ray.init's among them).
        atexit.unregister(close_all)
        atexit.register(close_all)


def untrack(owner: Closeable) -> None:
    """``owner`` was closed: nothing left to do for it at exit."""
    with _lock:
        _open.pop(id(owner), None)


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
