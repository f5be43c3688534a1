"""kvray's view for request routers: which node holds how much of a prompt's prefix.

Lives apart from :mod:`kvray.serving.router` because Ray Serve ships a router's module by
value (cloudpickle) to every process that routes: process-wide state (the shared kvray client
of :mod:`kvray.stores`, the key-space cache) must be imported there, not pickled.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvray import stores
from kvray.config import KVRayConfig
from kvray.registry import key_spaces
from kvray.serving.prompts import BlockHasher

if TYPE_CHECKING:
    from kvray.client import Store

__all__ = ["KeySpaceCache", "decision_metric", "held_blocks_by_node", "shared_store"]

#: How long a model's published key space is reused before it is read again.
KEY_SPACE_TTL_S = 5.0
#: Models whose key space a cache remembers (least recently used beyond).
MAX_MODELS = 64


def shared_store(namespace: str) -> Store:
    """The process's kvray client of ``namespace`` (:mod:`kvray.stores`), shared by every
    router in it; routers keep it for the process' life (its feed thread keeps the local view
    fresh)."""
    import kvray

    return stores.acquire(KVRayConfig(namespace=namespace), lambda: kvray.connect(namespace))


class KeySpaceCache:
    """The newest published key space per model, re-read every :data:`KEY_SPACE_TTL_S`."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._entries: OrderedDict[str, tuple[float, BlockHasher | None]] = OrderedDict()
        self._lock = threading.Lock()

    def hasher(self, model: str | None) -> BlockHasher | None:
        """The block hasher of ``model`` (its path or a served name); None: none published."""
        key = model or ""
        now = time.monotonic()
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and now - hit[0] < KEY_SPACE_TTL_S:
                self._entries.move_to_end(key)
                return hit[1]
        infos = key_spaces(self.namespace, model)
        hasher = BlockHasher(infos[0]) if infos else None
        with self._lock:
            self._entries[key] = (now, hasher)
            self._entries.move_to_end(key)
            while len(self._entries) > MAX_MODELS:
                self._entries.popitem(last=False)
        return hasher


def held_blocks_by_node(
    prefix_by_node: Callable[[Sequence[bytes]], dict[str, int]],
    keys_per_shard: Sequence[Sequence[bytes]],
) -> dict[str, int]:
    """Per node, the leading blocks held under every shard prefix (min over the shards)."""
    held: dict[str, int] | None = None
    for keys in keys_per_shard:
        counts = prefix_by_node(keys)
        held = (
            counts
            if held is None
            else {n: min(c, counts.get(n, 0)) for n, c in held.items() if n in counts}
        )
    return held or {}


def decision_metric(namespace: str, reasons: Sequence[str]) -> Any:
    """The ``kvray_router_decisions`` counter, exported from 0 for every reason (None where
    Ray metrics are unavailable)."""
    try:
        from ray.util.metrics import Counter

        from kvray.metrics import export_zero

        counter = Counter(
            "kvray_router_decisions",
            description="Requests routed by KVRayRouter, by reason (prefix, imbalanced, cold...)",
            tag_keys=("reason", "namespace"),
        )
    except Exception:
        return None
    for reason in reasons:
        export_zero(counter, {"reason": reason, "namespace": namespace})
    return counter
