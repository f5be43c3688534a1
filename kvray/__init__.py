"""kvray: a Ray-based distributed KV cache service for vLLM.

``kvray.start()`` deploys a global index and one block pool per node on a connected Ray
cluster; ``kvray.connect()`` gives any process on the cluster put / lookup / get of KV blocks.
The vLLM connector lives in :mod:`kvray.connector` (importing kvray never imports vLLM).

Importing ``kvray`` loads only the Ray-free core (config, errors, keys): ``start``, ``stop``,
``connect`` and ``Store`` are resolved on first use (PEP 562), so
``import kvray.kernels`` or ``import kvray.meta`` works where Ray is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvray.config import ConfigError, KVRayConfig
from kvray.errors import (
    BlockLostError,
    InvalidArgumentError,
    KVRayError,
    NotStartedError,
    StoreUnavailableError,
)
from kvray.keys import LayoutFingerprint, make_keys
from kvray.lazy import lazy_attributes
from kvray.meta.messages import PutResult

if TYPE_CHECKING:
    from kvray.actors.deploy import start, stop
    from kvray.client import Store, connect

__version__ = "0.1.0"

#: Public names that need Ray, by the module that defines them.
_LAZY = {
    "start": "kvray.actors.deploy",
    "stop": "kvray.actors.deploy",
    "connect": "kvray.client",
    "Store": "kvray.client",
}


__getattr__, __dir__ = lazy_attributes("kvray", _LAZY, globals())


__all__ = [
    "BlockLostError",
    "ConfigError",
    "InvalidArgumentError",
    "KVRayConfig",
    "KVRayError",
    "LayoutFingerprint",
    "NotStartedError",
    "PutResult",
    "Store",
    "StoreUnavailableError",
    "__version__",
    "connect",
    "make_keys",
    "start",
    "stop",
]
