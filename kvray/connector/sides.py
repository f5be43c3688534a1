"""The connector's seams, as Protocols (this module imports neither Ray nor vLLM).

- The scheduler side (:class:`~kvray.connector.scheduler.KVRayConnectorScheduler`) plans over
  one :class:`CacheManager` (:class:`~kvray.connector.manager.KVRayCacheManager`), which answers
  from one :class:`ViewStore`.
- The worker side (:class:`~kvray.connector.worker.KVRayConnectorWorker`) hands every job to one
  :class:`TransferSide` (:class:`~kvray.connector.transfer.TransferHandler`): ``submit`` by job
  id, ``wait``, ``get_finished``, one path whatever the load mode; it reads and writes through
  one :class:`TransferStore`.

Both stores are a :class:`kvray.Store` used through its public methods only.
tests/test_connector_sides.py checks that the classes above conform, signatures included.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent

    from kvray.blocks import Blocks, Fetched
    from kvray.connector.manager import LoadPlan
    from kvray.connector.metadata import (
        JobId,
        KVRayConnectorMetadata,
        KVRayWorkerMetadata,
        ReqId,
        TransferCounters,
    )
    from kvray.meta.messages import PutResult
    from kvray.meta.view import LocalView

__all__ = ["CacheManager", "TransferSide", "TransferStore", "ViewStore"]


@runtime_checkable
class ViewStore(Protocol):
    """What the scheduler side needs of a subscribed :class:`kvray.Store`."""

    def local_view(self) -> LocalView: ...

    def lookup(self, keys: Sequence[bytes]) -> int: ...

    def count(self, **figures: int) -> None: ...


@runtime_checkable
class TransferStore(Protocol):
    """What the worker side needs of a :class:`kvray.Store` (no view: workers keep none)."""

    def fetch_from(
        self,
        keys: Sequence[bytes],
        ids: np.ndarray,
        shard: int,
        slots: Sequence[int] | np.ndarray,
        pools: dict[int, str],
        timeout: float,
    ) -> Fetched: ...

    def verify(self, fetched: Fetched, sums: Sequence[int | None] | None = None) -> int: ...

    def put_shard(
        self, keys: list[bytes], ids: np.ndarray, shard: int, num_shards: int, blocks: Blocks
    ) -> Future[PutResult]: ...

    def put_cpu_seconds(self) -> float: ...

    def count(self, **figures: int) -> None: ...


@runtime_checkable
class CacheManager(Protocol):
    """The scheduler side's one view of kvray: every answer local, no actor call."""

    store: ViewStore

    def lookup(self, block_hashes: Sequence[bytes]) -> int: ...

    def find(self, block_hashes: Sequence[bytes]) -> tuple[int, int]: ...

    def present(self, block_hashes: Sequence[bytes]) -> np.ndarray: ...

    def prepare_load(self, block_hashes: Sequence[bytes], grouping: int = 0) -> LoadPlan: ...

    def complete_store(
        self, block_hashes: list[bytes], token_ids: list[int], parent: bytes | None
    ) -> None: ...

    def take_events(self) -> list[KVCacheEvent]: ...

    def close(self) -> None: ...


@runtime_checkable
class TransferSide(Protocol):
    """One TP rank's transfers: jobs in by id, completions out."""

    def submit(self, job_ids: Iterable[JobId], meta: KVRayConnectorMetadata) -> None: ...

    def wait(self, layer_name: str | None = None) -> None: ...

    def get_finished(self) -> tuple[set[ReqId], set[ReqId], set[ReqId]]: ...

    def load_errors(self) -> set[int]: ...

    def take_meta(self) -> KVRayWorkerMetadata | None: ...

    def counters(self) -> TransferCounters: ...

    def flush(self, timeout: float = 30.0) -> None: ...

    def shutdown(self) -> None: ...
