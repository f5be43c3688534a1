"""Where ``kvray serve`` listens: Ray Serve's HTTP proxy, started, reused or refused.

Ray Serve has one HTTP proxy configuration per cluster, set by whoever starts Serve first;
``serve.start(http_options=...)`` on a cluster where Serve already runs only logs "New
http_options ... will not be applied" and the app answers on the old port. So before deploying,
:func:`open_ingress` looks at the Serve that runs (if any):

- none: Serve is started on the asked host and port, and stopped again on exit;
- one listening where asked (its host, or all interfaces, and the port): it is reused, and left
  running on exit;
- one listening elsewhere with no application: an idle proxy (a ``kvray serve`` that ended
  without stopping it, say): it is restarted where asked, and stopped on exit;
- one listening elsewhere with applications: refused with one line naming where it listens
  (its proxy cannot listen on a second port, and stopping it would stop those applications).

``port=None`` takes the running proxy's port, else :data:`DEFAULT_PORT`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvray.errors import KVRayError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_PORT",
    "Ingress",
    "close_ingress",
    "open_ingress",
    "serving",
    "stop_serve",
    "wait_routed",
]

#: Serve's own default HTTP port.
DEFAULT_PORT = 8000
#: How long :func:`stop_serve` waits for Serve's actors (its proxies) to be gone.
STOP_TIMEOUT_S = 30.0
#: How long :func:`serving` waits for the proxy to route to an app ``serve.run`` deployed.
ROUTE_TIMEOUT_S = 60.0
_ANY_HOST = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class Ingress:
    """Where the app answers, and whether :func:`open_ingress` started Serve (so stops it)."""

    host: str
    port: int
    started: bool
    #: What was done to a Serve found running (for the user), or "".
    note: str = ""

    @property
    def url(self) -> str:
        """The OpenAI API's base URL."""
        return f"http://{self.host}:{self.port}/v1"


def running_http() -> tuple[str | None, int] | None:
    """The (host, port) of the Serve running on this cluster (host None: its HTTP proxy is
    off), or None when Serve does not run. Starts nothing."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None
    opts = client.http_config
    return opts.host, int(opts.port)


def stop_serve(timeout_s: float = STOP_TIMEOUT_S) -> None:
    """``serve.shutdown()``, then wait (bounded) until Serve's actors are gone: it returns once
    the controller is dead, while the proxies it killed may still be registered, and a Serve
    started again at once can get a dying proxy by its name (``ActorDiedError`` from
    ``serve.start``)."""
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_NAMESPACE

    serve.shutdown()
    deadline = time.monotonic() + timeout_s
    while True:
        left = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == SERVE_NAMESPACE
        ]
        if not left:
            return
        if time.monotonic() > deadline:
            logger.warning(
                "kvray serve: Serve's actors %s outlived its shutdown by %.0f s", left, timeout_s
            )
            return
        time.sleep(0.2)


def _apps(exclude: str) -> list[str]:
    from ray import serve

    return sorted(a for a in serve.status().applications if a != exclude)


def _serves(running: tuple[str | None, int], host: str, port: int) -> bool:
    r_host, r_port = running
    return r_port == port and r_host is not None and (r_host == host or r_host in _ANY_HOST)


def open_ingress(host: str, port: int | None, app_name: str) -> Ingress:
    """Make Serve's HTTP proxy listen at ``host:port`` (see the module docstring); raises
    :class:`KVRayError` (one line) when a Serve with applications listens elsewhere.
    ``app_name``: the application about to be deployed (replacing it is not a conflict)."""
    from ray import serve

    running = running_http()
    if running is None:
        port = DEFAULT_PORT if port is None else port
        serve.start(http_options={"host": host, "port": port})
        return Ingress(host, port, started=True)
    r_host, r_port = running
    if port is None and r_host is not None and (r_host == host or r_host in _ANY_HOST):
        port = r_port
    port = DEFAULT_PORT if port is None else port
    if _serves(running, host, port):
        return Ingress(host, port, started=False)
    where = f"at http://{r_host}:{r_port}" if r_host is not None else "off"
    others = _apps(exclude=app_name)
    if others:
        there = f"pass --port {r_port} --host {r_host} to serve there, or " if r_host else ""
        raise KVRayError(
            f"kvray serve: Ray Serve already runs on this cluster with its HTTP proxy {where} "
            f"(applications: {', '.join(others)}) and cannot also listen on {host}:{port}: "
            f"{there}stop those applications (`serve shutdown`)"
        )
    # An idle Serve (no application): nothing is lost by restarting it where asked.
    logger.info("kvray serve: restarting Ray Serve (idle, proxy %s) at %s:%d", where, host, port)
    stop_serve()
    serve.start(http_options={"host": host, "port": port})
    return Ingress(
        host,
        port,
        started=True,
        note=f"Ray Serve ran idle with its HTTP proxy {where}; restarted at {host}:{port}",
    )


def close_ingress(ingress: Ingress, app_name: str) -> None:
    """Delete the app; stop Serve too if :func:`open_ingress` started it and no other
    application runs on it meanwhile."""
    from ray import serve

    try:
        serve.delete(app_name)  # bounded: Serve waits 60 s at most
    finally:
        if ingress.started:
            others = _apps(exclude=app_name)
            if others:
                logger.warning(
                    "kvray serve: Ray Serve left running for applications %s", ", ".join(others)
                )
            else:
                stop_serve()


def wait_routed(ingress: Ingress, app_name: str, timeout_s: float = ROUTE_TIMEOUT_S) -> None:
    """Wait until Serve's proxy at ``ingress`` routes ``/`` to ``app_name`` (its
    ``/-/routes``): ``serve.run`` returns once the app's replicas are up, and a proxy started
    or restarted just before may answer 404 for a moment after. :class:`KVRayError` if it
    does not within ``timeout_s``."""
    import json
    import urllib.request

    host = "127.0.0.1" if ingress.host in _ANY_HOST else ingress.host
    url = f"http://{host}:{ingress.port}/-/routes"
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                routes = json.loads(r.read() or b"{}")
            if isinstance(routes, dict) and routes.get("/") == app_name:
                return
            last = f"routes {routes}"
        except (OSError, ValueError) as e:  # not listening yet, or not JSON yet
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise KVRayError(
                f"kvray serve: Serve's proxy at {host}:{ingress.port} does not route to "
                f"{app_name!r} {timeout_s:.0f} s after it was deployed ({last})"
            )
        time.sleep(0.2)


@contextmanager
def serving(
    app: Any,
    app_name: str,
    host: str,
    port: int | None,
    prepare: Callable[[], None] | None = None,
) -> Iterator[Ingress]:
    """Deploy ``app`` (``serve.run``) behind Serve's HTTP proxy at ``host:port``; yields
    where it answers; on exit the app is deleted and Serve stopped if this started it.
    ``prepare`` runs once the proxy listens where asked, before the deploy (what the app
    needs, e.g. ``kvray.start``: a refused ingress then leaves nothing started).
    Serve's "deployment failed" (with the replica's error) is a :class:`KVRayError`."""
    from ray import serve

    ingress = open_ingress(host, port, app_name)
    try:
        if prepare is not None:
            prepare()
        try:
            serve.run(app, name=app_name, route_prefix="/")
        except RuntimeError as e:
            raise KVRayError(f"kvray serve: the app did not start: {e}") from e
        wait_routed(ingress, app_name)
        yield ingress
    finally:
        close_ingress(ingress, app_name)
