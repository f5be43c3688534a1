"""``kvray.serve``: serve vLLM with kvray on Ray Serve LLM (see :mod:`kvray.serving`).

``build_app(model, replicas=2, namespace=...)`` returns a Ray Serve application: vLLM's OpenAI
server on every replica with kvray's connector, routed by :class:`KVRayRouter`.
"""

from kvray.serving import (
    ROUTERS,
    KVRayConnectorBackend,
    build_app,
    build_llm_config,
    register_backend,
)
from kvray.serving.router import KVRayRouter

__all__ = [
    "ROUTERS",
    "KVRayConnectorBackend",
    "KVRayRouter",
    "build_app",
    "build_llm_config",
    "register_backend",
]
