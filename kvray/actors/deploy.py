"""Start and stop kvray on a connected Ray cluster.

``start`` is idempotent: the index is created once (named, detached, restartable) and it puts a
pool on every alive node, now and whenever a node joins. ``stop`` removes the index first, so it
cannot re-create the pools being removed.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import ray

from kvray.actors.index import BlockIndexActor
from kvray.actors.types import RAY_NAMESPACE, index_name, pool_prefix
from kvray.config import KVRayConfig
from kvray.errors import NotStartedError, StoreUnavailableError

logger = logging.getLogger(__name__)


def ensure_ray(address: str | None = None, connect_timeout_s: float = 5.0) -> None:
    """Connect this process to Ray if it is not yet: ``address``, else ``RAY_ADDRESS``, else
    ``auto`` (the cluster started on this machine by ``ray start``); ``local`` starts one.

    Ray itself retries an unreachable address for minutes; a TCP probe first turns that into a
    clear error within seconds.
    """
    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    if target != "local":
        try:
            from ray._private.services import canonicalize_bootstrap_address_or_die

            resolved = canonicalize_bootstrap_address_or_die(target)
        except ConnectionError as e:
            raise StoreUnavailableError(
                f"kvray: no Ray cluster found ({target}): {_first_line(str(e))}"
            ) from e
        _probe(resolved, connect_timeout_s)
    try:
        ray.init(address=target, namespace=RAY_NAMESPACE, log_to_driver=False)
    except (ConnectionError, ray.exceptions.AuthenticationError) as e:
        chain = _error_chain(e)
        if (
            "InvalidAuthToken" in chain
            or "Unauthenticated" in chain
            or isinstance(e, ray.exceptions.AuthenticationError)
        ):
            raise StoreUnavailableError(
                f"kvray: the Ray cluster at {target} requires a valid auth token: set "
                "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token) to the cluster's "
                "token (`ray get-auth-token` on the head) and RAY_AUTH_MODE=token"
            ) from e
        raise StoreUnavailableError(
            f"kvray: cannot join the Ray cluster at {target}: {_first_line(str(e))}"
        ) from e


def _error_chain(e: BaseException) -> str:
    parts = []
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        parts.append(f"{type(cur).__name__}: {cur}")
        cur = cur.__cause__ or cur.__context__
    return " | ".join(parts)


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _probe(address: str, timeout: float) -> None:
    """Fail fast when nothing listens at ``host:port``."""
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise StoreUnavailableError(
            f"kvray: no Ray cluster answers at {hostport} ({e.strerror or e}); "
            "start one with `ray start --head` or pass the right --address"
        ) from e


def get_index(namespace: str) -> Any:
    """The index actor of a namespace, or :class:`NotStartedError`."""
    try:
        return ray.get_actor(index_name(namespace), namespace=RAY_NAMESPACE)
    except ValueError:
        raise NotStartedError(
            f"kvray is not started in namespace {namespace!r} on this cluster "
            f"(run `kvray start --namespace {namespace}` or kvray.start())"
        ) from None


def start(config: KVRayConfig | None = None, **fields: Any) -> dict[str, Any]:
    """Deploy kvray (index + one pool per alive node) on the connected cluster.

    Calling it again is harmless: an existing index is reused as it is (a different capacity
    is reported, not applied: stop first to change it). Returns the index's stats.
    """
    # One validation path for every entry point: unknown keys (a typo) are ConfigErrors and
    # CLI-style strings ("2GiB", "false") are converted as in kv_connector_extra_config.
    cfg = KVRayConfig.from_dict({**(config or KVRayConfig()).to_dict(), **fields})
    ensure_ray(cfg.address)
    index = BlockIndexActor.options(  # type: ignore[attr-defined]
        name=index_name(cfg.namespace),
        namespace=RAY_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
        max_task_retries=-1,
        max_concurrency=1000,
    ).remote(cfg.to_dict())
    deadline = time.monotonic() + max(cfg.get_timeout_s, 60.0)
    try:
        pools = ray.get(index.ensure_pools.remote(), timeout=max(cfg.get_timeout_s, 60.0))
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        while pools < alive and time.monotonic() < deadline:
            time.sleep(0.2)
            pools = ray.get(index.ensure_pools.remote(), timeout=cfg.get_timeout_s)
        stats: dict[str, Any] = ray.get(index.stats.remote(), timeout=cfg.get_timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise StoreUnavailableError(
            f"kvray: the index in namespace {cfg.namespace!r} did not come up in time"
        ) from e
    running = stats["config"]
    if running["capacity"] != cfg.capacity:
        logger.warning(
            "kvray already runs in namespace %r with capacity %d (asked %d); kept as it is",
            cfg.namespace,
            running["capacity"],
            cfg.capacity,
        )
    logger.info("kvray started in namespace %r: %d pool(s)", cfg.namespace, stats["pools"])
    return stats


def stop(namespace: str = "default") -> int:
    """Remove kvray's actors (and so its blocks) from the cluster. Returns actors removed."""
    ensure_ray(None)
    removed = 0
    try:
        index = get_index(namespace)
    except NotStartedError:
        index = None
    if index is not None:
        try:
            ray.get(index.shutdown.remote(), timeout=10)
            # Waiting long polls return "stopped" at once; give them a moment to get out so
            # Ray does not retry them against a dead actor.
            time.sleep(0.2)
        except Exception:
            logger.warning("kvray stop: index did not answer; killing it anyway")
        ray.kill(index, no_restart=True)
        removed += 1
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor.get("namespace") == RAY_NAMESPACE and actor["name"].startswith(
            pool_prefix(namespace)
        ):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=RAY_NAMESPACE), no_restart=True)
                removed += 1
            except ValueError:
                pass
    return removed
