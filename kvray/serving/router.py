"""``KVRayRouter``: a Ray Serve request router that sends a prompt to where kvray holds its prefix.

For each request it computes the kvray keys of the prompt's full blocks (see
:mod:`kvray.serving.prompts`), asks kvray's local view (no actor call) how many leading blocks
each node's pool holds, and ranks the replicas on the node holding the longest prefix first:
there the prefix is in vLLM's own cache or loads from the node's pool without crossing the
network. It never piles everything on one replica: when the preferred replicas' queues are
longer than the least loaded replica's by more than ``imbalanced_threshold`` requests, the
least loaded replica gets the request (kvray's pools make a cross-node prefix cheap there
too). Prompts with no cached prefix go to the shorter queue of two random replicas (power of
two choices). Selected with
``RequestRouterConfig(request_router_class=KVRayRouter, request_router_kwargs={...})``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvray.config import ConfigError, check_namespace
from kvray.serving.prompts import PromptSource, TokenizerLike, prompt_of, token_ids_of
from kvray.serving.tokenize import EngineTokenizer
from kvray.serving.view import KeySpaceCache, decision_metric, held_blocks_by_node, shared_store
from kvray.threads import SupervisedThread

logger = logging.getLogger(__name__)

__all__ = ["KVRayRouter"]

#: Decision reasons counted (metric ``kvray_router_decisions``).
REASONS = ("prefix", "imbalanced", "cold", "no_prompt", "no_key_space", "error")


class KVRayRouter(RequestRouter):
    """Prefers the replicas on the node whose kvray pool holds the longest prompt prefix."""

    def initialize_state(
        self,
        namespace: str = "default",
        engine_kwargs: dict[str, Any] | None = None,
        imbalanced_threshold: int = 1,
        min_blocks: int = 1,
    ) -> None:
        """``engine_kwargs``: the engine's arguments (``model`` included) for the pre-routing
        tokenizer of text and chat prompts; without them only token-id prompts are routed by
        prefix."""
        check_namespace(namespace)
        for name, value, low in (
            ("imbalanced_threshold", imbalanced_threshold, 0),
            ("min_blocks", min_blocks, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(name, value, f"KVRayRouter expects an integer >= {low}")
        self._namespace = namespace
        self._imbalanced_threshold = imbalanced_threshold
        self._min_blocks = min_blocks
        self._engine_kwargs = engine_kwargs
        self._tokenizer: TokenizerLike | None = None
        self._store: Any = None
        self._spaces = KeySpaceCache(namespace)
        self.decisions: Counter[str] = Counter()
        self._metric = decision_metric(namespace, REASONS)
        # One shot, supervised: a failure is logged and counted (``thread_deaths``); the store
        # is then connected on the first request, and text prompts route by load only.
        self._init = SupervisedThread(
            self._warm_up, "kvray-router-init", f"KVRayRouter of {namespace!r}", restarts=0
        ).start()

    @property
    def thread_deaths(self) -> int:
        return self._init.deaths

    # ------------------------------------------------------------ background setup
    def _warm_up(self) -> None:
        """Connect to kvray and build the tokenizer off the event loop (seconds)."""
        try:
            self._store = shared_store(self._namespace)
        except Exception as e:  # not started yet: retried per request (bounded by the TTL)
            logger.warning("KVRayRouter: kvray namespace %r: %s", self._namespace, e)
        if self._engine_kwargs is not None:
            try:
                self._tokenizer = EngineTokenizer(self._engine_kwargs)
            except Exception:
                logger.exception("KVRayRouter: no tokenizer; text prompts route by load only")

    # ------------------------------------------------------------ routing
    async def held_blocks(self, source: PromptSource) -> dict[str, int] | None:
        """Per node, how many leading blocks of the prompt kvray holds; None: not known."""
        hasher = await asyncio.to_thread(self._spaces.hasher, source.model)
        if hasher is None:
            self._count("no_key_space")
            return None
        tokens = await token_ids_of(source, self._tokenizer)
        if not tokens:
            self._count("no_prompt")
            return None
        if self._store is None:
            self._store = await asyncio.to_thread(shared_store, self._namespace)
        hashes = hasher.block_hashes(tokens, source.cache_salt)
        return held_blocks_by_node(self._store.prefix_by_node, hasher.keys_per_shard(hashes))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        source = None
        if pending_request is not None and pending_request.args:
            source = prompt_of(pending_request.args[0])
        held: dict[str, int] | None = None
        if source is None:
            self._count("no_prompt")
        else:
            try:
                held = await self.held_blocks(source)
            except Exception as e:  # routing must not fail a request: fall back to load
                logger.warning("KVRayRouter: prefix lookup failed: %s: %s", type(e).__name__, e)
                self._count("error")
        if held:
            best = max(held.get(r.node_id, 0) for r in candidate_replicas)
            if best >= self._min_blocks:
                preferred = [r for r in candidate_replicas if held.get(r.node_id, 0) == best]
                queues = await self._queue_lens(candidate_replicas)
                least = min(queues.values())
                if min(queues[r.replica_id] for r in preferred) - least <= (
                    self._imbalanced_threshold
                ):
                    self._count("prefix")
                    rest = [r for r in candidate_replicas if r not in preferred]
                    return [preferred, rest] if rest else [preferred]
                self._count("imbalanced")
                return [[r for r in candidate_replicas if queues[r.replica_id] == least]]
        if source is not None and held is not None:
            self._count("cold")
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        return [two]

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[Any, float]:
        """Ongoing requests per replica: the router's cache, probing the ones missing."""
        out: dict[Any, float] = {}
        missing = []
        for r in replicas:
            q = self._replica_queue_len_cache.get(r.replica_id)
            if q is None:
                missing.append(r)
            else:
                out[r.replica_id] = q
        if missing:
            for r, q in await self._probe_queue_lens(missing, 0):
                out[r.replica_id] = q if q is not None else float("inf")
        return out

    def _count(self, reason: str) -> None:
        self.decisions[reason] += 1
        if self._metric is not None:
            self._metric.inc(tags={"reason": reason, "namespace": self._namespace})
