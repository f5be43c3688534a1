"""Joining the Ray cluster and the kvray namespace from inside a vLLM process.

Every vLLM process that hosts a half of the connector (the EngineCore's scheduler, each worker
rank) calls :func:`open_store` once at construction. The rules, so that a misconfigured engine
fails at start with one clear message instead of hanging or silently running without a cache:

- Ray already initialised in this process (in-process engine, a Ray actor): use it.
- else join ``address`` from the config, or ``RAY_ADDRESS``; neither set: error (we never start
  a private cluster unless ``address="local"``). A ``HOST:PORT`` that accepts no TCP connection
  within a few seconds is reported before ``ray.init`` gets a chance to retry for minutes.
- kvray not running in the namespace: start it when ``auto_start`` (idempotent and safe when
  several ranks race), else error.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from kvray import stores
from kvray.config import KVRayConfig
from kvray.errors import NotStartedError, StoreUnavailableError

if TYPE_CHECKING:
    from kvray.client import Store

logger = logging.getLogger(__name__)


def join_cluster(config: KVRayConfig) -> None:
    """Make sure this process is connected to the Ray cluster kvray runs on."""
    import ray

    if ray.is_initialized():
        return
    address = config.address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise StoreUnavailableError(
            "kvray connector: no Ray cluster to join: set RAY_ADDRESS or the 'address' key of "
            "kv_connector_extra_config (use address='local' for a private single-node cluster)"
        )
    from kvray.cluster import ensure_ray

    ensure_ray(address)  # probes HOST:PORT first: an unreachable cluster fails in seconds


def open_store(config: KVRayConfig, *, subscribe: bool = True, retries: int = 3) -> Store:
    """The process's store client for ``config`` (joining the cluster and starting kvray in
    the namespace if needed), shared through :mod:`kvray.stores`; give it back with
    :func:`close_store`. ``subscribe``: the store keeps a view of the index (a scheduler does;
    a worker does not, unless it shares the process with a scheduler); without the engine tier:
    the connector's lookups never read it (routers do, from their own store)."""
    return stores.acquire(
        config,
        lambda: _connect(config, retries, subscribe),
        subscribe=subscribe,
        engine_view=False,
    )


def close_store(store: Store) -> None:
    """Drop one reference to a store from :func:`open_store`; the last one closes it."""
    stores.release(store)


def _connect(config: KVRayConfig, retries: int, subscribe: bool) -> Store:
    import kvray

    join_cluster(config)
    last: Exception | None = None
    for attempt in range(retries):
        try:
            return kvray.connect(config.namespace, config, subscribe=subscribe, engine_view=False)
        except NotStartedError as e:
            last = e
            if not config.auto_start:
                raise
            logger.info("kvray: starting kvray in namespace %r", config.namespace)
            try:
                kvray.start(config)
            except Exception as start_err:  # a racing rank may win: retry connect
                last = start_err
                time.sleep(0.2 * (attempt + 1))
    raise StoreUnavailableError(
        f"kvray connector: could not start or connect to namespace {config.namespace!r}: {last}"
    )
