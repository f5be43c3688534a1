"""Small values the scheduler-side and worker-side halves of the connector exchange.

The scheduler plans *jobs* (a load or a store of a run of whole blocks of one request) and names
each with an integer id. Every TP rank executes its own shard of every job and reports
``{job_id: 1}`` in its :class:`KVRayWorkerMetadata`; ``aggregate`` sums the reports of all
ranks, and the scheduler treats a job as done once the sum reaches the world size. Keys travel
as vLLM block hashes (rank-independent) and loads carry where each block lives (the scheduler's
view of the index: workers keep no view) and the grouping they were stored in, so the metadata
is identical for all ranks and small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvray.meta.holders import decode_slots

ReqId = str
JobId = int


@dataclass
class LoadSpec:
    """Copy blocks ``block_hashes[i]`` from kvray into paged-cache block ``block_ids[i]``.

    ``is_async``: the request waits in ``WAITING_FOR_REMOTE_KVS`` and the worker reports it in
    ``finished_recving``; otherwise the load must complete inside ``start_load_kv``.
    """

    req_id: ReqId
    block_ids: list[int]
    block_hashes: list[bytes]
    #: Location code of each block (:mod:`kvray.meta.holders`): the pool slot holding every
    #: shard, or a placement code for split blocks (its tuple in ``placements``).
    locs: list[int] = field(default_factory=list)
    is_async: bool = False
    #: Shards the blocks were stored in (their head grouping; 0: the engine's own). Each rank
    #: reads the stored shards holding its heads (:func:`kvray.kernels.heads.head_parts`).
    grouping: int = 0
    #: A prefill's handoff: blocks not (yet) in their pool are looked for again for this long
    #: (the prefill may still be putting them), then reported failed.
    wait_s: float = 0.0
    #: Pool slot -> pool actor name, for every slot this load names.
    pools: dict[int, str] = field(default_factory=dict)
    #: The pool slot of each shard of every block split across pools, in the order of their
    #: positions in ``locs`` (:func:`~kvray.meta.holders.split_positions`). The load carries
    #: its own: placement codes are numbered per index shard (and per handoff), so a code
    #: means nothing outside the plan that resolved it.
    placements: list[tuple[int, ...]] = field(default_factory=list)
    #: The KV cache group (vLLM's index) the blocks belong to (0: the one group).
    group: int = 0

    def slots(self, shard: int) -> list[int]:
        """The pool slot holding shard ``shard`` of each block (-1: unknown)."""
        return decode_slots(np.asarray(self.locs, dtype=np.int64), shard, self.placements).tolist()


@dataclass
class StoreSpec:
    """Copy paged-cache blocks ``block_ids[i]`` into kvray under ``block_hashes[i]``.

    ``finish``: the request has finished and its blocks are kept alive for this store only;
    every rank reports ``req_id`` in ``finished_sending`` once its copy no longer reads them.
    """

    req_id: ReqId
    block_ids: list[int]
    block_hashes: list[bytes]
    finish: bool = False
    #: With ``finish``: report ``finished_sending`` only once every put of the request is
    #: owned by a pool (a prefill handing its blocks to a remote decode), not once gathered.
    hold: bool = False
    #: The KV cache group (vLLM's index) the blocks belong to (0: the one group).
    group: int = 0


@dataclass
class KVRayConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per engine step."""

    loads: dict[JobId, LoadSpec] = field(default_factory=dict)
    stores: dict[JobId, StoreSpec] = field(default_factory=dict)
    #: Requests whose blocks are about to be reused (preempted): saves reading them must end.
    preempted_req_ids: set[ReqId] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.preempted_req_ids)


@dataclass
class TransferCounters:
    """Per-step byte and block counts, summed over ranks; feeds connector stats and tests."""

    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    failed_blocks: int = 0
    stored_blocks: int = 0
    duplicate_blocks: int = 0
    refused_blocks: int = 0
    dropped_blocks: int = 0
    stored_bytes: int = 0
    #: Seconds the store pieces took from the engine's process (the gather and hand-off on
    #: the engine thread, the put threads' CPU), and the blocks of those pieces (what a store
    #: costs here, for ``store_seen_only="auto"``).
    store_seconds: float = 0.0
    store_timed_blocks: int = 0

    def add(self, other: TransferCounters) -> TransferCounters:
        return TransferCounters(
            **{k: getattr(self, k) + getattr(other, k) for k in self.__dataclass_fields__}
        )


@dataclass
class KVRayWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: job completions since the last step, summed over ranks.

    ``failed_jobs`` counts ranks on which the job's data did not (fully) reach its destination
    (a load with lost blocks, a store that was refused or dropped): such blocks must not be
    announced as stored.
    """

    completed_jobs: dict[JobId, int] = field(default_factory=dict)
    failed_jobs: dict[JobId, int] = field(default_factory=dict)
    counters: TransferCounters = field(default_factory=TransferCounters)

    def mark(self, job_id: JobId, ok: bool = True) -> None:
        self.completed_jobs[job_id] = self.completed_jobs.get(job_id, 0) + 1
        if not ok:
            self.failed_jobs[job_id] = self.failed_jobs.get(job_id, 0) + 1

    def is_empty(self) -> bool:
        return not self.completed_jobs and self.counters == TransferCounters()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVRayWorkerMetadata:
        if not isinstance(other, KVRayWorkerMetadata):
            raise TypeError(f"KVRayWorkerMetadata: cannot aggregate {type(other).__name__}")
        completed = dict(self.completed_jobs)
        for job_id, n in other.completed_jobs.items():
            completed[job_id] = completed.get(job_id, 0) + n
        failed = dict(self.failed_jobs)
        for job_id, n in other.failed_jobs.items():
            failed[job_id] = failed.get(job_id, 0) + n
        return KVRayWorkerMetadata(
            completed_jobs=completed,
            failed_jobs=failed,
            counters=self.counters.add(other.counters),
        )
