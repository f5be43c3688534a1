"""kvray's view for request routers: which node holds how much of a prompt's prefix.

Lives apart from :mod:`kvray.serving.router` because Ray Serve ships a router's module by
value (cloudpickle) to every process that routes: process-wide state (the shared kvray client
of :mod:`kvray.stores`, the key-space cache) must be imported there, not pickled.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvray import stores
from kvray.config import KVRayConfig
from kvray.meta.ids import engine_ids, key_ids
from kvray.registry import key_spaces
from kvray.serving.prompts import BlockHasher
from kvray.threads import SupervisedThread

if TYPE_CHECKING:
    from kvray.client import Store

__all__ = [
    "KeySpaceCache",
    "LookupLoop",
    "PromptTiers",
    "decision_metric",
    "held_blocks_by_node",
    "shared_store",
]

#: How long a model's published key space is reused before it is read again.
KEY_SPACE_TTL_S = 5.0
#: Models whose key space a cache remembers (least recently used beyond).
MAX_MODELS = 64
#: Longest a routing lookup may take; past it the request is routed by load.
LOOKUP_TIMEOUT_S = 2.0

_T = TypeVar("_T")


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
    except ImportError:  # Ray without its metrics module
        return None
    for reason in reasons:
        export_zero(counter, {"reason": reason, "namespace": namespace})
    return counter


@dataclass(frozen=True)
class PromptTiers:
    """A prompt's prefix in every tier: ``total`` full blocks; per replica key, (leading blocks
    in its engine cache, its engine's KV usage); per node, leading blocks in kvray's pool
    there; leading blocks kvray holds anywhere; the blocks' engine-tier ids (what a router
    remembers having sent where, :class:`~kvray.serving.inflight.InFlight`) and, per replica
    key, the leading blocks of them routed there lately (filled in by the router)."""

    total: int
    engine: dict[str, tuple[int, float]]
    by_node: dict[str, int]
    anywhere: int
    ids: tuple[int, ...] = ()
    routed: dict[str, int] = field(default_factory=dict)
    #: Tokens per block of the engines the prompt was keyed for.
    block_size: int = 0

    @classmethod
    def of(
        cls, store: Store, hasher: BlockHasher, tokens: Sequence[int], salt: str | None
    ) -> PromptTiers:
        hashes = hasher.block_hashes(tokens, salt)
        if not hashes:
            return cls(0, {}, {}, 0, block_size=hasher.info.block_size)
        view = store.local_view()
        per_shard = hasher.keys_per_shard(hashes)
        by_node = held_blocks_by_node(store.prefix_by_node, per_shard)
        anywhere = min(view.lookup(key_ids(keys)) for keys in per_shard)
        ids = engine_ids(hashes)
        engine = view.engine_prefix(ids)
        return cls(
            len(hashes),
            engine,
            by_node,
            anywhere,
            tuple(ids.tolist()),
            block_size=hasher.info.block_size,
        )


class LookupLoop:
    """An event loop on a supervised thread of its own: routing lookups (the tokenizer's
    coroutines included) run there, so Serve's loop only awaits their result."""

    def __init__(self, owner: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = SupervisedThread(
            self._loop.run_forever,
            "kvray-router-lookup",
            owner,
            restarts=3,
            wake=lambda: self._loop.call_soon_threadsafe(self._loop.stop),
        ).start()

    @property
    def deaths(self) -> int:
        return self._thread.deaths

    async def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), LOOKUP_TIMEOUT_S)
        except TimeoutError:
            fut.cancel()
            raise
