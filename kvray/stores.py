"""One store client per configuration and process, shared by everything in the process that
needs one: the connector's halves (vLLM's EngineCore hosts the scheduler and, at TP=1, the
worker), every request router of a Serve process. One feed thread and one view instead of one
per user (less background work next to the forward pass). Reference-counted: the last
:func:`release` closes the store.

Imports no Ray itself (the connector's worker side imports it): the store comes from the
caller's ``connect``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvray.config import KVRayConfig

if TYPE_CHECKING:
    from kvray.client import Store

__all__ = ["acquire", "release"]

_shared: dict[KVRayConfig, tuple[Store, int]] = {}
_lock = threading.Lock()


def acquire(
    config: KVRayConfig,
    connect: Callable[[], Store],
    *,
    subscribe: bool = True,
    engine_view: bool = True,
) -> Store:
    """The process's open store for ``config``, or a new one from ``connect()`` (a closed one,
    e.g. after ``kvray.stop``, is replaced). ``subscribe``: the store keeps a view of the index
    from now on (``engine_view``: with the engine tier). Give it back with :func:`release`."""
    with _lock:
        entry = _shared.get(config)
        if entry is not None and not entry[0].closed:
            store, refs = entry
            if subscribe:
                store.subscribe(engine_view)
            _shared[config] = (store, refs + 1)
            return store
        store = connect()
        _shared[config] = (store, 1)
        return store


def release(store: Store) -> None:
    """Drop one reference to a store from :func:`acquire`; the last one closes it (a store
    that is not shared is closed at once)."""
    with _lock:
        for config, (shared, refs) in list(_shared.items()):
            if shared is store:
                if refs > 1:
                    _shared[config] = (shared, refs - 1)
                    return
                del _shared[config]
                break
    store.close()
