"""``KVRayRouter``: a Ray Serve request router that scores every cache tier and the load.

For each request it computes the prompt's block hashes (token ids from the request, or from
vLLM's own renderer for text and chat; see :mod:`kvray.serving.prompts`), then reads kvray's
local view (no actor call): per replica, how many leading blocks its own engine cache holds
(the engine tier, reported by each replica's connector), how many kvray's pool on its node
holds, and how many kvray holds anywhere. Each candidate gets the score of
:mod:`kvray.serving.score` (tiers weighted 1.0 / 0.8 / 0.5, minus its queue and its engine's
KV usage); the best goes first, ties by power of two choices. Prompts with nothing to score
go to the shorter queue of two random replicas. Between the engine's report and the routing,
the router's own memory fills in (:mod:`kvray.serving.inflight`): which replica it sent each
recent prompt's blocks to, and the requests it routed that Serve has not counted in a
replica's queue yet (a burst's requests otherwise all see the same queue lengths).

The whole lookup (tokenizing, hashing, reading the view) runs on the router's own thread and
event loop, never on Serve's. Decisions are counted by reason (metric
``kvray_router_decisions``). Selected with
``RequestRouterConfig(request_router_class=KVRayRouter, request_router_kwargs={...})``.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvray.config import ConfigError, check_namespace
from kvray.meta.costs import Costs
from kvray.serving.inflight import TTL_S, InFlight, Unsent
from kvray.serving.prompts import PromptSource, TokenizerLike, prompt_of
from kvray.serving.routeview import (
    KeySpaceCache,
    LookupLoop,
    PromptTiers,
    decision_metric,
    shared_store,
)
from kvray.serving.score import Candidate, Weights, pick, pick_ttft
from kvray.serving.tokenize import EngineTokenizer
from kvray.threads import SupervisedThread

logger = logging.getLogger(__name__)

__all__ = ["KVRayRouter"]

#: The scores a router may use: tier weights (``weights``) or the predicted time to first
#: token from the engines' published costs (``ttft``; the weights until any engine published).
SCORES = ("weights", "ttft")

#: Decision reasons counted (metric ``kvray_router_decisions``).
REASONS = (
    "engine",
    "kvray_node",
    "kvray_remote",
    "balanced",
    "cold",
    "no_prompt",
    "no_key_space",
    "error",
)


class KVRayRouter(RequestRouter):
    """Scores each replica by the prompt prefix its engine and kvray hold, and its load."""

    def initialize_state(
        self,
        namespace: str = "default",
        engine_kwargs: dict[str, Any] | None = None,
        weights: Mapping[str, float] | None = None,
        inflight_s: float = TTL_S,
        score: str = "weights",
    ) -> None:
        """``engine_kwargs``: the engine's arguments (``model`` included) for the pre-routing
        tokenizer of text and chat prompts; without them only token-id prompts are scored.
        ``weights``: the score's weights by name (:class:`~kvray.serving.score.Weights`).
        ``inflight_s``: how long a routed prompt's blocks count as in its replica's engine
        before the engine tier reports them (:mod:`kvray.serving.inflight`; 0: never).
        ``score``: ``"weights"`` or ``"ttft"`` (:mod:`kvray.serving.score`)."""
        check_namespace(namespace)
        if score not in SCORES:
            raise ConfigError("score", score, f"expected one of {SCORES}")
        self._score = score
        self._namespace = namespace
        self._weights = Weights.of(weights)
        self._inflight = InFlight(inflight_s)
        self._unsent = Unsent()
        self._engine_kwargs = engine_kwargs
        self._tokenizer: TokenizerLike | None = None
        self._store: Any = None
        self._spaces = KeySpaceCache(namespace)
        self._lookups = LookupLoop(f"KVRayRouter of {namespace!r}")
        self.decisions: Counter[str] = Counter()
        self._metric = decision_metric(namespace, REASONS)
        # One shot, supervised: a failure is logged and counted (``thread_deaths``); the store
        # is then connected on the first request, and text prompts route by load only.
        self._init = SupervisedThread(
            self._warm_up, "kvray-router-init", f"KVRayRouter of {namespace!r}", restarts=0
        ).start()

    @property
    def thread_deaths(self) -> int:
        return self._init.deaths + self._lookups.deaths

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

    # ------------------------------------------------------------ lookups (router's loop)
    async def _tiers(self, source: PromptSource) -> PromptTiers | str:
        """The prompt's prefix in every tier, or the reason it has none (runs on the lookup
        thread's loop)."""
        hasher = self._spaces.hasher(source.model)
        if hasher is None:
            return "no_key_space"
        tokens = source.token_ids
        if tokens is None and self._tokenizer is not None and source.request is not None:
            tokens = await self._tokenizer.token_ids(source.request)
        if not tokens:
            return "no_prompt"
        if self._store is None:
            self._store = shared_store(self._namespace)
        return PromptTiers.of(self._store, hasher, tokens, source.cache_salt)

    async def prompt_tiers(self, source: PromptSource) -> PromptTiers | str:
        """:meth:`_tiers` on the router's own thread: Serve's event loop only awaits it."""
        return await self._lookups.run(self._tiers(source))

    # ------------------------------------------------------------ routing
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
        tiers: PromptTiers | str = "no_prompt"
        if source is not None:
            try:
                tiers = await self.prompt_tiers(source)
            except Exception as e:  # routing must not fail a request: fall back to load
                logger.warning("KVRayRouter: prefix lookup failed: %s: %s", type(e).__name__, e)
                tiers = "error"
        if isinstance(tiers, str) or not tiers.total:
            self._count(tiers if isinstance(tiers, str) else "no_prompt")
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        queues = await self._queue_lens(candidate_replicas)
        # No await from here to note(): requests routed concurrently see each other's choice.
        now = time.monotonic()
        routed = self._inflight.prefix(tiers.ids, now)
        if routed:
            tiers = dataclasses.replace(tiers, routed=routed)
        costs = self._costs() if self._score == "ttft" else {}
        cands = [
            self._candidate(
                r,
                tiers,
                queues[r.replica_id] + self._unsent.pending(r.replica_id.unique_id, now),
                costs,
            )
            for r in candidate_replicas
        ]
        chosen = None
        if costs and tiers.block_size:
            chosen = pick_ttft(candidate_replicas, tiers.total, cands, tiers.block_size)
        if chosen is None:  # the weights: asked for, or no engine published estimates yet
            chosen = pick(candidate_replicas, tiers.total, cands, self._weights)
        ranked, reason = chosen
        first = ranked[0].replica_id.unique_id
        self._inflight.note(first, tiers.ids, now)
        self._unsent.chosen(first, now)
        self._count(reason)
        return [[ranked[0]], ranked[1:]] if len(ranked) > 1 else [ranked]

    def on_send_request(self, replica_id: Any) -> None:
        """Serve sent a request and counted it: the router's decision no longer counts."""
        super().on_send_request(replica_id)
        self._unsent.sent(replica_id.unique_id)

    def on_new_queue_len_info(self, replica_id: Any, num_ongoing_requests: int) -> None:
        """The replica's own count (the request it accepted, refused or reserved included)."""
        super().on_new_queue_len_info(replica_id, num_ongoing_requests)
        self._unsent.answered(replica_id.unique_id)

    def _costs(self) -> dict[str, Costs | None]:
        """Per replica key, its engine's published costs (from the view; no actor call)."""
        if self._store is None:
            return {}
        try:
            wire = self._store.local_view().engine_costs()
        except Exception as e:  # routing by weights rather than failing a request
            logger.debug("KVRayRouter: no cost estimates: %s: %s", type(e).__name__, e)
            return {}
        return {key: Costs.from_wire(values) for key, values in wire.items()}

    @staticmethod
    def _candidate(
        r: RunningReplica,
        tiers: PromptTiers,
        queue: float,
        costs: Mapping[str, Costs | None] | None = None,
    ) -> Candidate:
        key = r.replica_id.unique_id
        engine, usage = tiers.engine.get(key, (0, 0.0))
        return Candidate(
            engine=max(engine, tiers.routed.get(key, 0)),
            node_pool=tiers.by_node.get(r.node_id, 0),
            anywhere=tiers.anywhere,
            queue=min(queue, 1e6),  # a replica that did not answer the probe: last
            usage=usage,
            costs=(costs or {}).get(key),
        )

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
