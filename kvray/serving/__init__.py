"""Serving vLLM with kvray on Ray Serve LLM: the app builder, the connector backend and the
prefix-aware request router. Importing this package imports Ray Serve LLM (not vLLM)."""

from kvray.serving.app import ROUTERS, build_app, build_llm_config
from kvray.serving.backend import KVRayConnectorBackend, register_backend

__all__ = ["ROUTERS", "KVRayConnectorBackend", "build_app", "build_llm_config", "register_backend"]
