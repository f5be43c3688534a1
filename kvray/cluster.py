"""Joining a Ray cluster from a kvray process: fail fast and clearly when it cannot be reached.

Also the client's way to a running namespace (:func:`get_control`). Needs Ray, never the
actor classes: a client (a vLLM worker) imports this, not :mod:`kvray.actors.deploy`.
"""

from __future__ import annotations

import os
import random
import socket
from typing import TYPE_CHECKING

import ray

from kvray.errors import NotStartedError, StoreUnavailableError
from kvray.meta.messages import RAY_NAMESPACE, control_name

if TYPE_CHECKING:
    from kvray.handles import ControlHandle

__all__ = ["ensure_ray", "get_control", "local_node_id"]

#: Names the node whose pool this process writes to, over Ray's own answer.
NODE_ENV = "KVRAY_NODE_ID"


def local_node_id() -> str:
    """This process's node, whose pool its puts go to.

    Ray's answer, unless ``KVRAY_NODE_ID`` says otherwise: a process that joins with
    ``ray.init(address=...)`` is attached to one raylet of its host, which on a host running
    several raylets (a simulated multi-node cluster) need not be the node of the Ray actor that
    started it. kvray's Ray Serve backend sets it in each replica, so vLLM's engine processes
    write to their replica's node."""
    return os.environ.get(NODE_ENV) or ray.get_runtime_context().get_node_id()


def get_control(namespace: str) -> ControlHandle:
    """The reconciler of a namespace, or :class:`NotStartedError`."""
    try:
        return ray.get_actor(control_name(namespace), namespace=RAY_NAMESPACE)
    except ValueError:
        raise NotStartedError(
            f"kvray is not started in namespace {namespace!r} on this cluster "
            f"(run `kvray start --namespace {namespace}` or kvray.start())"
        ) from None


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
        with _unseeded_random():
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


class _unseeded_random:
    """Run ``ray.init`` with Python's ``random`` freshly seeded, then give the caller its state
    back.

    Ray draws each driver's GCS subscriber ids from the global ``random`` module
    (``_GcsSubscriber._construct``: ``random.getrandbits``). vLLM seeds it with the engine's
    seed before its processes join Ray through kvray, so every engine of a deployment (same
    seed, 0 by default) got the *same* subscriber id for Ray's error channel: their long polls
    evicted each other, ~5,000 ``GcsSubscriberPoll`` RPCs a second for as long as the engines
    lived, a core of GCS and worker CPU (issue 17). vLLM's own seeded state is restored, so its
    sampling stays reproducible.
    """

    def __enter__(self) -> None:
        self._state = random.getstate()
        random.seed(os.urandom(32))

    def __exit__(self, *exc: object) -> None:
        random.setstate(self._state)


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
