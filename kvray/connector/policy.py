"""Which ``kv_load_failure_policy`` vLLM acts on for kvray's loads, and the refusal of an unsafe
one.

kvray is a cache: a block can be evicted, or lost with its node, between the lookup and the
load. vLLM's scheduler then either recomputes the missing tokens (``"recompute"``) or fails the
request (``"fail"``, vLLM's default). It reads the policy from the engine's own
``vllm_config.kv_transfer_config`` and nowhere else.

Alone, kvray is built with that config. As a child of a wrapping connector (vLLM's
``MultiConnector``, which pairs a store connector with a transfer connector), kvray is built
with a copy of the engine's config whose ``kv_transfer_config`` is synthesized from kvray's own
entry in the wrapper's ``"connectors"`` list: it carries vLLM's default ``"fail"`` whatever the
engine's policy is, and the engine's config is not reachable from it (a shallow copy with that
one field replaced). The wrapper that constructs kvray does hold the engine's config: it is
found on the call stack, as the ``self`` of the outermost connector ``__init__`` that is
running, and its policy is the one checked.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvray.callers import outermost_caller
from kvray.config import ConfigError

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig

__all__ = ["enclosing_connector", "require_recompute_policy"]

logger = logging.getLogger(__name__)

_REASON = (
    "kvray is a cache whose blocks can be evicted or lost with their node between lookup and "
    "load, and this policy fails the request instead of recomputing it; "
)
_FIX = 'set "kv_load_failure_policy": "recompute" in --kv-transfer-config'


def enclosing_connector(connector: object) -> KVConnectorBase_V1 | None:
    """The outermost connector whose ``__init__`` is constructing ``connector`` (a wrapper such
    as vLLM's ``MultiConnector``, built by vLLM's scheduler or worker from the engine's
    config), or None when ``connector`` is the engine's own connector."""
    wrapper = outermost_caller(connector, KVConnectorBase_V1, "__init__")
    if wrapper is None or getattr(wrapper, "_kv_transfer_config", None) is None:
        return None
    return wrapper


def require_recompute_policy(connector: object, vllm_config: VllmConfig) -> None:
    """Fail closed unless vLLM recomputes what kvray fails to load.

    The policy checked is the one vLLM acts on: the engine's, reached through the wrapping
    connector when kvray is a child of one (``vllm_config`` is then a per-child copy whose
    policy vLLM never reads), else ``vllm_config``'s own.
    """
    own: KVTransferConfig | None = vllm_config.kv_transfer_config
    wrapper = enclosing_connector(connector)
    if wrapper is None:
        policy = getattr(own, "kv_load_failure_policy", None)
        if policy != "recompute":
            raise ConfigError("kv_load_failure_policy", policy, _REASON + _FIX)
        return
    name = type(wrapper).__name__
    engine_ktc: KVTransferConfig = wrapper._kv_transfer_config
    policy = getattr(engine_ktc, "kv_load_failure_policy", None)
    if policy != "recompute":
        raise ConfigError(
            "kv_load_failure_policy",
            policy,
            _REASON
            + _FIX
            + f' at the top level, next to "kv_connector": "{name}" (vLLM acts on the '
            f"engine's policy, not on the entries of the connectors inside {name})",
        )
    child = getattr(own, "kv_load_failure_policy", None)
    if child != policy:
        logger.info(
            "kvray: inside %s, vLLM acts on the engine's kv_load_failure_policy=%r (the "
            "per-connector copy of the config handed to kvray says %r; vLLM does not read it)",
            name,
            policy,
            child,
        )
