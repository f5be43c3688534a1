"""vLLM KV connector for kvray: ``--kv-transfer-config '{"kv_connector": "KVRayConnector",
"kv_connector_module_path": "kvray.connector", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"namespace": ...}}'``.

The package map (in the style of vLLM's ``offloading_connector.py`` beside ``offloading/``):

- :mod:`.connector`: :class:`KVRayConnector`, the facade vLLM builds (imports vLLM);
- the scheduler side: :mod:`.scheduler` (jobs), :mod:`.manager` (lookups and load plans over
  the view), :mod:`.pricing` (what a load and a recompute cost here), :mod:`.handoff` (P/D),
  :mod:`.quarantine`, :mod:`.reporter` (the engine's own cache, for routers);
- the worker side: :mod:`.worker`, :mod:`.transfer` (the one transfer handler), :mod:`.loads`,
  :mod:`.saves`, :mod:`.paged`;
- both: :mod:`.metadata` (what they exchange), :mod:`.keyspace` (an engine's keys),
  :mod:`.sides` (the seams, as Protocols), :mod:`.attach` (joining Ray from vLLM's processes),
  :mod:`.policy`.

Importing this package imports nothing: ``KVRayConnector`` (and the names below) resolve on
first use, so a module such as :mod:`.sides` imports without vLLM. ``import kvray`` does not
import this package.
"""

from __future__ import annotations

from kvray.lazy import lazy_attributes

__all__ = [
    "KVRayConnector",
    "KVRayConnectorMetadata",
    "KVRayConnectorScheduler",
    "KVRayConnectorWorker",
    "KVRayWorkerMetadata",
]

_WHERE = {
    "KVRayConnector": "kvray.connector.connector",
    "KVRayConnectorMetadata": "kvray.connector.metadata",
    "KVRayWorkerMetadata": "kvray.connector.metadata",
    "KVRayConnectorScheduler": "kvray.connector.scheduler",
    "KVRayConnectorWorker": "kvray.connector.worker",
}


__getattr__, __dir__ = lazy_attributes("kvray.connector", _WHERE, globals())
