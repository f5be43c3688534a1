"""Serving vLLM with kvray on Ray Serve LLM: the app builder, the connector backend and the
prefix-aware request router. Importing this package imports Ray Serve LLM (not vLLM).

``build_app(model, replicas=2, namespace=...)`` returns a Ray Serve application: vLLM's OpenAI
server on every replica with kvray's connector, routed by :class:`KVRayRouter` (resolved on
first use: :mod:`.router` imports more).
"""

from __future__ import annotations

from typing import Any

from kvray.serving.app import ROUTERS, build_app, build_llm_config
from kvray.serving.backend import KVRayConnectorBackend, register_backend

__all__ = [
    "ROUTERS",
    "KVRayConnectorBackend",
    "KVRayRouter",
    "build_app",
    "build_llm_config",
    "register_backend",
]


def __getattr__(name: str) -> Any:
    if name == "KVRayRouter":
        from kvray.serving.router import KVRayRouter

        return KVRayRouter
    raise AttributeError(f"module 'kvray.serving' has no attribute {name!r}")
