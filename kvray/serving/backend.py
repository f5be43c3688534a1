"""kvray as a Ray Serve LLM connector backend: a user only names ``KVRayConnector``.

Ray Serve LLM looks the ``kv_connector`` of ``engine_kwargs["kv_transfer_config"]`` up in its
connector-backend factory and calls the backend's ``setup()`` in every replica before the
engine starts. kvray's backend fills in what vLLM and kvray need in that replica: where the
connector class lives, its role, recompute on a failed load, the kvray namespace, and the Ray
cluster address, so that vLLM's EngineCore and worker processes (children of the replica, not
Ray workers themselves) join the replica's cluster. The extra config is validated there, so a
bad key stops the replica with kvray's own message instead of an engine half started. Inside
Ray Serve LLM's ``MultiConnector`` backend, which runs this one on a copy of the deployment's
config, the same is filled into kvray's entry of the original (the engine is built from it),
and the engine's top-level ``kv_load_failure_policy`` defaults to ``"recompute"``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (
    BaseConnectorBackend,
    DefaultPDProtocolMixin,
)
from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory

from kvray.callers import outermost_caller
from kvray.cluster import NODE_ENV
from kvray.config import ConfigError, KVRayConfig
from kvray.meta.engine_table import REPLICA_ENV
from kvray.serving.app import local_ranks

logger = logging.getLogger(__name__)

__all__ = ["CONNECTOR_NAME", "KVRayConnectorBackend", "register_backend"]

#: The ``kv_connector`` name users write.
CONNECTOR_NAME = "KVRayConnector"
#: Where vLLM imports the connector class from.
CONNECTOR_MODULE = "kvray.connector"
#: kvray's entry in a prefill's ``kv_transfer_params`` (``kvray.connector.handoff``'s
#: ``HANDOFF_KEY``; not imported: that package imports vLLM).
HANDOFF_KEY = "kvray"
#: vLLM-CPU's count of cores kept away from the forward pass's OpenMP threads.
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def cpu_reservation(engine_kwargs: dict[str, Any]) -> int:
    """The cores vLLM-CPU reserves per node *without* a connector: one per local rank.

    With any ``kv_transfer_config`` it reserves one more per rank, for NIXL's transfer thread
    under P/D (``vllm/utils/ompmultiprocessing.py``). kvray moves blocks on the worker's own
    thread, so it needs no such core; on a box with as many cores as ranks plus one, that extra
    reservation leaves none reserved at all: the forward pass's OpenMP threads then spin against
    the scheduler process on every core (measured on the 2-core box, Ray's multi-turn benchmark:
    decode ITL 54 ms against 15 ms for the same app without a connector)."""
    return local_ranks(engine_kwargs)


class KVRayConnectorBackend(DefaultPDProtocolMixin, BaseConnectorBackend):
    """Per-replica setup of kvray's connector inside Ray Serve LLM, and the shaping of P/D
    requests: Ray's default protocol (no peer binding, sequential handoff: the decode needs
    the pools the prefill's response names), with two rules of kvray's own. A client's own
    ``kv_transfer_params`` never reach the prefill (they are replaced, not an assertion
    error), and the decode gets the prefill's params only when they carry kvray's handoff:
    anything else is dropped and the decode computes the prompt itself."""

    def prepare_prefill_request(self, *, request: Any, peer: dict[str, Any] | None) -> Any:
        from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (
            base_prefill_kv_transfer_params,
            clamp_request_to_single_token,
        )

        prefill = request.model_copy(deep=True)
        prefill.kv_transfer_params = base_prefill_kv_transfer_params()
        clamp_request_to_single_token(prefill)
        return prefill

    def prepare_decode_request(
        self, *, request: Any, peer: dict[str, Any] | None, prefill_response: Any | None
    ) -> Any:
        decode = request.model_copy(deep=True)
        params = getattr(prefill_response, "kv_transfer_params", None)
        if isinstance(params, dict) and isinstance(params.get(HANDOFF_KEY), dict):
            decode.kv_transfer_params = params
        else:
            decode.kv_transfer_params = None
            if prefill_response is not None:
                logger.warning("kvray P/D: the prefill returned no handoff; decode computes")
        return decode

    def setup(self) -> None:
        import ray

        ktc: dict[str, Any] = self.kv_transfer_config
        config = _complete_entry(ktc)  # fail here, with kvray's message
        ktc.setdefault("kv_load_failure_policy", "recompute")
        wrapper = outermost_caller(self, BaseConnectorBackend, "setup")
        if wrapper is not None:
            _complete_wrapper(wrapper.kv_transfer_config, type(wrapper).__name__)
        if ray.is_initialized():
            # vLLM's engine processes inherit it: they write to this replica's node's pool
            # even where Ray attaches them to another raylet of the host.
            os.environ.setdefault(NODE_ENV, ray.get_runtime_context().get_node_id())
            # The engine tier names this replica as Serve's router sees it.
            os.environ[REPLICA_ENV] = _replica_id() or os.environ.get(REPLICA_ENV, "")
        # The engine processes inherit this too (read by vLLM-CPU only; a user's value wins).
        os.environ.setdefault(
            RESERVED_CPU_ENV, str(cpu_reservation(dict(self.llm_config.engine_kwargs)))
        )
        logger.info(
            "kvray backend: replica joins namespace %r at %s", config.namespace, config.address
        )


def _replica_id() -> str | None:
    """This Serve replica's unique id (``RunningReplica.replica_id.unique_id``), if any."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except RayServeException:  # not inside a Serve replica
        return None


def _complete_entry(ktc: dict[str, Any]) -> KVRayConfig:
    """Fill in what vLLM and kvray need in kvray's ``kv_transfer_config`` (or its entry in a
    MultiConnector's ``connectors``), then validate the extra config."""
    import ray

    module = ktc.setdefault("kv_connector_module_path", CONNECTOR_MODULE)
    if module != CONNECTOR_MODULE:
        raise ConfigError(
            "kv_connector_module_path", module, f"KVRayConnector lives in {CONNECTOR_MODULE}"
        )
    ktc.setdefault("kv_role", "kv_both")
    extra = ktc.get("kv_connector_extra_config")
    if extra is None:
        extra = ktc["kv_connector_extra_config"] = {}
    extra.setdefault("namespace", "default")
    if ray.is_initialized():
        extra.setdefault("address", ray.get_runtime_context().gcs_address)
    return KVRayConfig.from_dict(extra)


def _complete_wrapper(ktc: dict[str, Any], name: str) -> None:
    """kvray's backend run by a wrapping backend (Ray Serve LLM's ``MultiConnectorBackend``):
    that one sets each child up on a deep copy of the deployment's config, while the engine is
    built from the original. Complete kvray's entries in the original, and default the engine's
    ``kv_load_failure_policy`` (the top-level one: the only one vLLM acts on) to
    ``"recompute"``; an explicit other policy is refused here rather than by the engine."""
    entries = (ktc.get("kv_connector_extra_config") or {}).get("connectors") or []
    for entry in entries:
        if isinstance(entry, dict) and entry.get("kv_connector") == CONNECTOR_NAME:
            _complete_entry(entry)
    policy = ktc.setdefault("kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise ConfigError(
            "kv_load_failure_policy",
            policy,
            f"kvray inside {name} needs the engine to recompute the blocks it fails to load: "
            f'set "kv_load_failure_policy": "recompute" at the top level of '
            "kv_transfer_config (the policy vLLM acts on)",
        )
    logger.info("kvray backend: completed kvray's entry of the %s config", name)


def register_backend() -> None:
    """Register kvray's backend with Ray Serve LLM (idempotent; every process of the cluster
    sees it once Ray is initialised here, through Ray's internal KV store)."""
    if not KVConnectorBackendFactory.is_registered(CONNECTOR_NAME):
        KVConnectorBackendFactory.register_backend(
            CONNECTOR_NAME, f"{__name__}:{KVRayConnectorBackend.__name__}"
        )
