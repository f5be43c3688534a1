"""``kvray serve``: one vLLM engine per node as Ray actors, with prefix-aware routing.

Works wherever vLLM runs, the CPU build included (vLLM's own Ray executor is GPU-only). Each
replica is an actor pinned to its node with kvray's connector on. The router lives in the caller's
process: it hashes a prompt's full blocks exactly as vLLM does (same hash function, same chained
seed), looks the keys up in kvray's local view (no actor call) and sends the request to the node
that holds the longest cached prefix, so the replica loads it from its own node's pool. Prompts
with no cached prefix go to the least busy replica. The handle is usable from Python
(:meth:`ServeHandle.generate`) or over an OpenAI-compatible HTTP endpoint (:func:`run_http`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

import kvray
from kvray.config import KVRayConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaInfo:
    """What the router needs to know of a replica to compute its keys."""

    node_id: str
    block_size: int
    hash_algo: str
    shard_prefixes: list[bytes]
    model: str


@ray.remote
class EngineReplica:
    """A vLLM engine (in-process mode) with kvray on, inside one Ray actor."""

    def __init__(self, model: str, engine_args: dict[str, Any], extra_config: dict[str, Any]):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.config import KVTransferConfig

        args = dict(engine_args)
        args.setdefault("distributed_executor_backend", "uni")
        self._model = model
        self._llm = LLM(
            model=model,
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVRayConnector",
                kv_connector_module_path="kvray.connector",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra_config,
            ),
            **args,
        )
        self._lock = threading.Lock()

    def close(self) -> None:
        """Shut the engine down cleanly: the connector finishes the saves still in flight."""
        self._llm.llm_engine.engine_core.shutdown()

    def info(self) -> ReplicaInfo:
        core = self._llm.llm_engine.engine_core.engine_core
        connector = core.scheduler.connector
        cache = self._llm.llm_engine.vllm_config.cache_config
        return ReplicaInfo(
            node_id=ray.get_runtime_context().get_node_id(),
            block_size=int(cache.block_size),
            hash_algo=str(cache.prefix_caching_hash_algo),
            shard_prefixes=[connector.key_space.prefix],
            model=self._model,
        )

    def generate(self, prompt_token_ids: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(**sampling)
        with self._lock:  # one LLM.generate at a time per engine
            t0 = time.perf_counter()
            (out,) = self._llm.generate(
                [TokensPrompt(prompt_token_ids=list(prompt_token_ids))], params, use_tqdm=False
            )
            seconds = time.perf_counter() - t0
        comp = out.outputs[0]
        return {
            "token_ids": list(comp.token_ids),
            "text": comp.text or "",
            "finish_reason": comp.finish_reason,
            "num_cached_tokens": int(out.num_cached_tokens or 0),
            "prompt_tokens": len(prompt_token_ids),
            "node_id": ray.get_runtime_context().get_node_id(),
            "seconds": seconds,
        }


@dataclass
class ServeHandle:
    """Routes requests to per-node replicas by where kvray holds the prompt's prefix."""

    replicas: dict[str, Any]
    infos: dict[str, ReplicaInfo]
    store: kvray.Store
    _busy: dict[str, int] = field(default_factory=dict)
    _rr: Any = field(default_factory=lambda: itertools.count())
    _hash_fn: Any = None

    def __post_init__(self) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import init_none_hash

        algos = {i.hash_algo for i in self.infos.values()}
        if len(algos) != 1:
            raise ValueError(f"kvray serve: replicas disagree on the hash algorithm: {algos}")
        self._hash_fn = get_hash_fn_by_name(algos.pop())
        init_none_hash(self._hash_fn)
        self._busy = dict.fromkeys(self.replicas, 0)

    def block_hashes(self, tokens: Sequence[int], block_size: int) -> list[bytes]:
        """vLLM's chained hashes of the full blocks of a plain token prompt."""
        from vllm.v1.core.kv_cache_utils import hash_block_tokens

        out: list[bytes] = []
        parent = None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = hash_block_tokens(self._hash_fn, parent, tokens[start : start + block_size])
            out.append(bytes(parent))
        return out

    def cached_blocks(self, tokens: Sequence[int]) -> dict[str, int]:
        """Per node: how many leading blocks of ``tokens`` its pool holds for every shard."""
        info = next(iter(self.infos.values()))
        hashes = self.block_hashes(tokens, info.block_size)
        by_node: dict[str, int] = dict.fromkeys(self.replicas, 0)
        for node_id in by_node:
            n = 0
            for h in hashes:
                if not all(
                    node_id in self.store.holder_nodes(prefix + h) for prefix in info.shard_prefixes
                ):
                    break
                n += 1
            by_node[node_id] = n
        return by_node

    def route(self, tokens: Sequence[int]) -> str:
        """The node whose pool holds the longest prefix; else the least busy replica."""
        cached = self.cached_blocks(tokens)
        best = max(cached.values(), default=0)
        if best > 0:
            return min((n for n, c in cached.items() if c == best), key=lambda n: self._busy[n])
        nodes = sorted(self.replicas, key=lambda n: (self._busy[n], n))
        least = self._busy[nodes[0]]
        ties = [n for n in nodes if self._busy[n] == least]
        return ties[next(self._rr) % len(ties)]

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: dict[str, Any] | None = None,
        node_id: str | None = None,
        timeout: float = 600.0,
    ) -> dict[str, Any]:
        """Run one request; ``node_id`` forces a replica, else :meth:`route` picks it."""
        node = node_id or self.route(prompt_token_ids)
        if node not in self.replicas:
            raise ValueError(f"kvray serve: no replica on node {node}")
        self._busy[node] += 1
        try:
            ref = self.replicas[node].generate.remote(list(prompt_token_ids), sampling or {})
            return ray.get(ref, timeout=timeout)
        finally:
            self._busy[node] -= 1

    def shutdown(self, timeout: float = 60.0) -> None:
        """Close every replica (flushing its saves), then remove the actors."""
        refs = [h.close.remote() for h in self.replicas.values()]
        try:
            ray.get(refs, timeout=timeout)
        except Exception:
            logger.warning("kvray serve: a replica did not close cleanly", exc_info=True)
        for handle in self.replicas.values():
            ray.kill(handle)
        self.store.close()


def start_serving(
    model: str,
    *,
    config: KVRayConfig | None = None,
    engine_args: dict[str, Any] | None = None,
    node_ids: Sequence[str] | None = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    start_timeout_s: float = 600.0,
) -> ServeHandle:
    """Start one replica per alive node (or per ``node_ids``) and return a routing handle."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cfg = config or KVRayConfig()
    kvray.start(cfg)
    if node_ids is None:
        node_ids = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    extra = {"namespace": cfg.namespace}
    replicas = {
        nid: EngineReplica.options(  # type: ignore[attr-defined]
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nid, soft=False),
        ).remote(model, engine_args or {}, extra)
        for nid in node_ids
    }
    infos = dict(
        zip(
            replicas,
            ray.get([r.info.remote() for r in replicas.values()], timeout=start_timeout_s),
            strict=True,
        )
    )
    return ServeHandle(replicas, infos, kvray.connect(cfg.namespace, cfg))


def run_http(handle: ServeHandle, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve :func:`make_app` until interrupted."""
    from aiohttp import web

    web.run_app(make_app(handle), host=host, port=port, print=None)


def make_app(handle: ServeHandle) -> Any:
    """An aiohttp app with an OpenAI-compatible ``/v1/completions`` (token-id prompts)."""
    from aiohttp import web

    model = next(iter(handle.infos.values())).model

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return web.json_response(
                {"error": {"message": "prompt must be a list of token ids", "type": "invalid"}},
                status=400,
            )
        sampling = {
            "max_tokens": int(body.get("max_tokens", 16)),
            "temperature": float(body.get("temperature", 0.0)),
        }
        result = await asyncio.to_thread(handle.generate, prompt, sampling)
        return web.json_response(
            {
                "id": f"cmpl-{time.time_ns()}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": result["text"],
                        "token_ids": result["token_ids"],
                        "finish_reason": result["finish_reason"],
                    }
                ],
                "usage": {
                    "prompt_tokens": result["prompt_tokens"],
                    "completion_tokens": len(result["token_ids"]),
                    "prompt_tokens_details": {"cached_tokens": result["num_cached_tokens"]},
                },
                "kvray": {"node_id": result["node_id"]},
            }
        )

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"replicas": len(handle.replicas)})

    app = web.Application()
    app.add_routes(
        [
            web.post("/v1/completions", completions),
            web.get("/v1/models", models),
            web.get("/health", health),
        ]
    )
    return app
