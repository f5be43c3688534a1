"""kvray: a Ray-based distributed KV cache service for vLLM.

``kvray.start()`` deploys a global index and one block pool per node on a connected Ray
cluster; ``kvray.connect()`` gives any process on the cluster put / lookup / get of KV blocks.
The vLLM connector lives in :mod:`kvray.connector` (importing kvray never imports vLLM).
"""

from kvray.actors.deploy import start, stop
from kvray.actors.types import PutResult
from kvray.client import Store, connect
from kvray.config import ConfigError, KVRayConfig
from kvray.errors import (
    BlockLostError,
    InvalidArgumentError,
    KVRayError,
    NotStartedError,
    StoreUnavailableError,
)
from kvray.keys import LayoutFingerprint, make_keys

__version__ = "0.1.0"

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
