"""``build_pd_app``: Ray Serve LLM's prefill/decode app with kvray as the KV transport.

Ray's P/D pattern (``build_pd_openai_app``): the ingress sends each chat or completion request
to a decode replica, which sends it first to a prefill replica with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": True, ...}``, then runs it on its own engine with
the ``kv_transfer_params`` the prefill returned (:class:`~kvray.serving.backend.
KVRayConnectorBackend` shapes both requests). With kvray on both sides the prefill's blocks
land in the cluster cache and the params name them and their pools
(:mod:`kvray.connector.handoff`): the decode loads them from there at once, and every later
request with the same prefix finds them in kvray too.

Both deployments are routed by kvray's router unless ``router`` says otherwise: a prefill
goes to the replica on the node holding the prompt's longest prefix, and so does its decode
(the prefill just stored the prompt in its node's pool, so the decode's load stays on the
node when a decode replica runs there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvray.config import ConfigError
from kvray.serving.app import build_llm_config

__all__ = ["build_pd_app", "parse_pd"]


def parse_pd(spec: str) -> tuple[int, int]:
    """``"P:D"`` -> (P, D), both integers >= 1."""
    parts = spec.split(":") if isinstance(spec, str) else []
    try:
        p, d = (int(x) for x in parts)
    except ValueError:
        raise ConfigError("pd", spec, "expected P:D, e.g. 1:1 (prefill:decode replicas)") from None
    if p < 1 or d < 1:
        raise ConfigError("pd", spec, "both replica counts must be >= 1")
    return p, d


def build_pd_app(
    model: str,
    *,
    prefill_replicas: int = 1,
    decode_replicas: int = 1,
    ingress_options: Mapping[str, Any] | None = None,
    prefill_overrides: Mapping[str, Any] | None = None,
    decode_overrides: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """A Ray Serve application: ``prefill_replicas`` prefill and ``decode_replicas`` decode
    replicas of ``model``, kvray's connector on both. ``kwargs``: :func:`~kvray.serving.app.
    build_llm_config`'s (namespace, engine_args, kvray_config, router, num_cpus...), for
    both sides; ``*_overrides``: the same, for one side only. Needs Ray initialised."""
    from ray.serve.llm import build_pd_openai_app

    from kvray.serving.backend import register_backend

    if kwargs.pop("kv_cache", "kvray") != "kvray":
        raise ConfigError("kv_cache", "none", "the P/D app moves the KV through kvray")
    if "replicas" in kwargs:
        raise ConfigError("replicas", kwargs["replicas"], "use prefill_replicas/decode_replicas")
    register_backend()
    prefill = build_llm_config(
        model, replicas=prefill_replicas, **{**kwargs, **dict(prefill_overrides or {})}
    )
    decode = build_llm_config(
        model, replicas=decode_replicas, **{**kwargs, **dict(decode_overrides or {})}
    )
    return build_pd_openai_app(
        {
            "prefill_config": prefill,
            "decode_config": decode,
            "ingress_deployment_config": dict(ingress_options or {}),
        }
    )
