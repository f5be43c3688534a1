"""Scheduler side of the kvray connector (runs in vLLM's EngineCore process).

It decides, per engine step, which blocks each worker rank loads from kvray and which it stores,
and never waits on Ray to do so: hit lengths and block locations come from the
:class:`KVRayCacheManager` (the local view of the index, microseconds), and completions come back
through the workers' metadata. Store jobs are cut to fit a worker's staging buffers, so a long
prefill chunk is stored in pieces rather than dropped every step.

Block lifetimes. Workers copy ("gather") a saved block out of the paged cache into a staging
buffer inside ``wait_for_save`` of the step that planned the store, so once that step's output
reaches the scheduler no save reads vLLM's blocks any more: a preempted or finished request's
blocks may be reused right away. The one exception is a request that finishes with full blocks
not yet stored (decode blocks wait for ``decode_store_blocks`` of them, so this is the common
case for requests that decode past a block): ``request_finished`` keeps its blocks
(``delay_free``) for one more step, plans a final store, and the blocks are freed when every
rank reports the request in ``finished_sending``. vLLM's engine loop takes that step by itself;
an in-process ``LLM`` takes it at its next ``generate`` or ``llm_engine.step()``, so
``reset_prefix_cache()`` straight after ``generate`` may return False until then.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvray.config import KVRayConfig
from kvray.connector.handoff import (
    HANDOFF_WAIT_S,
    Handoff,
    HandoffPlanner,
    hold_until_stored,
    wants_handoff,
)
from kvray.connector.keyspace import EngineKeySpace
from kvray.connector.metadata import (
    JobId,
    KVRayConnectorMetadata,
    KVRayWorkerMetadata,
    LoadSpec,
    ReqId,
    StoreSpec,
    TransferCounters,
)
from kvray.connector.pricing import Pricing
from kvray.connector.quarantine import Quarantine
from kvray.connector.sides import CacheManager, ViewStore

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _hit_tokens(request: Request, hit_end: int) -> int:
    """Where a hit of whole blocks ending at token ``hit_end`` stops: one token short of the
    prompt's end at most, since vLLM computes at least one token to sample from."""
    return min(hit_end, request.num_tokens - 1)


@dataclass
class _RequestState:
    request: Request
    #: The request's current paged-cache block ids (single attention group).
    block_ids: list[int] = field(default_factory=list)
    #: Blocks [0, n) are in kvray, being stored, or were hits: never planned again.
    num_planned_blocks: int = 0
    #: Locally computed tokens the last ``get_num_new_matched_tokens`` was told about.
    num_local_tokens: int = 0
    load_job: JobId | None = None
    load_is_async: bool = False
    #: The grouping the last lookup found the hit in (the next load reads it).
    hit_grouping: int = 0
    #: A prefill's handoff this (decode) request loads from (:mod:`.handoff`), once read.
    handoff: Handoff | None = None
    handoff_read: bool = False
    handoff_begun: bool = False
    #: Its hit was priced and found cheaper to compute (declines count once a request).
    declined: bool = False
    #: Its prompt tokens left to compute were measured (once, at its first allocation).
    seen: bool = False


@dataclass
class _Job:
    req_id: ReqId
    is_store: bool
    first_block: int
    block_ids: list[int]
    block_hashes: list[bytes]
    pending: int
    failed: int = 0
    #: For KV events: the tokens of the stored blocks and the parent hash.
    token_ids: list[int] = field(default_factory=list)
    parent_hash: bytes | None = None


class KVRayConnectorScheduler:
    """Plans loads and stores; tracks jobs until every rank reported them."""

    def __init__(
        self,
        config: KVRayConfig,
        key_space: EngineKeySpace,
        manager: CacheManager,
        *,
        world_size: int,
        local_pool: str = "",
    ) -> None:
        self.config = config
        self.key_space = key_space
        self.manager = manager
        self.block_size = key_space.block_size
        self.world_size = world_size
        #: A store job never has more blocks than a worker's staging pool holds.
        self.max_store_blocks = max(1, config.staging_bytes // max(1, key_space.block_nbytes))
        self.decode_store_blocks = config.decode_store_blocks
        self._load_async = config.load_mode == "async"
        self._job_ids = itertools.count(1)
        self._reqs: dict[ReqId, _RequestState] = {}
        self._jobs: dict[JobId, _Job] = {}
        # Jobs planned since the last build_connector_meta.
        self._new_loads: dict[JobId, LoadSpec] = {}
        self._new_stores: dict[JobId, StoreSpec] = {}
        #: Blocks that failed to load, not offered as hits for a while.
        self.quarantine = Quarantine()
        # Block hashes some store job is writing: other requests sharing the prefix skip them.
        self._storing: dict[bytes, JobId] = {}
        self.counters = TransferCounters()
        self.handoffs = HandoffPlanner(
            key_space, manager.store.local_view(), local_pool, config.namespace
        )
        #: Scheduler-side figures (tests and stats): tokens offered as hits (of them, stored by
        #: engines of another TP size), lookups made.
        self.hit_tokens = 0
        self.cross_tp_hit_tokens = 0
        self.lookups = 0
        #: Hits are cut to what pays to load (config ``price_loads``); else all loaded.
        self.price_loads = config.price_loads
        #: The engine's measured costs (issue 32), published for routers either way.
        self.pricing = Pricing(
            self.block_size,
            world_size,
            local_pool,
            manager.store.local_view,
            loads_in_step=not self._load_async,
        )

    # ---------------------------------------------------------------- lookups
    def _find_hit(self, block_hashes: list[bytes]) -> tuple[int, int]:
        """Longest prefix of blocks present in kvray with every head range this engine's ranks
        need (local view only), and the grouping it is stored in."""
        n = self.quarantine.usable(block_hashes)
        return self.manager.find(block_hashes[:n]) if n else (0, self.key_space.num_shards)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` kvray holds in full blocks on every shard.

        Never the whole prompt: vLLM must compute at least one token to sample from. A hit on
        every block of a prompt that fills its last block loads that block whole and reports
        one token less, so vLLM recomputes one token, not a block (the recomputed token's KV
        overwrites its loaded copy with the same values).
        """
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _RequestState(request)
        state.num_local_tokens = num_computed_tokens
        bs = self.block_size
        max_blocks = min(len(request.block_hashes), request.num_tokens // bs)
        start = num_computed_tokens // bs
        if max_blocks <= start:
            return 0, False
        hashes = list(request.block_hashes[:max_blocks])
        if not state.handoff_read:  # a prefill's params: load from where they say, at once
            state.handoff_read = True
            state.handoff = self.handoffs.read(request.kv_transfer_params, request.block_hashes)
        if state.handoff is not None:
            hit_blocks = self.quarantine.usable(hashes[: state.handoff.num_blocks])
            if hit_blocks > start:
                state.hit_grouping = state.handoff.grouping
                return _hit_tokens(request, hit_blocks * bs) - num_computed_tokens, self._load_async
        self.lookups += 1
        hit_blocks, state.hit_grouping = self._find_hit(hashes)
        if hit_blocks > start and self.price_loads and self.pricing.warm:
            hit_blocks = self._priced(state, hashes, start, hit_blocks)
        if hit_blocks <= start:
            return 0, False
        num_tokens = _hit_tokens(request, hit_blocks * bs) - num_computed_tokens
        return num_tokens, self._load_async

    def _priced(self, state: _RequestState, hashes: list[bytes], start: int, end: int) -> int:
        """Where the hit of blocks [start, end) should stop: the blocks whose load beats
        their recompute, by the engine's measured costs (:mod:`kvray.meta.costs`)."""
        ids = self.key_space.block_ids(hashes[start:end], state.hit_grouping)
        locs = self.store.local_view().locs(ids).astype(np.int64)
        keep = start + self.pricing.tokens_to_load(locs) // self.block_size
        if keep < end and not state.declined:
            state.declined = True
            tokens = (end - keep) * self.block_size
            self.pricing.declined(tokens)
            self.store.count(loads_declined=1, tokens_declined=tokens)
        return keep

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _RequestState(request)
        state.block_ids = list(blocks.get_block_ids()[0])
        if not state.seen:
            state.seen = True
            left = request.num_tokens - state.num_local_tokens - num_external_tokens
            self.pricing.request_seen(left)
        if num_external_tokens == 0:
            return
        bs = self.block_size
        # Whole blocks: a block vLLM computed part of is loaded whole (the same prefix's KV), and
        # so is a prompt's last block when the hit stops one token short of it.
        first = state.num_local_tokens // bs
        last = -(-(state.num_local_tokens + num_external_tokens) // bs)
        hashes = [bytes(h) for h in request.block_hashes[first:last]]
        handoff = state.handoff
        if handoff is not None and last <= handoff.num_blocks:
            plan = self.handoffs.locator.plan(handoff, first, last)
            self.handoffs.offered_tokens += num_external_tokens
        else:
            handoff = None
            plan = self.manager.prepare_load(hashes, state.hit_grouping)
        is_async = self._load_async
        job_id = next(self._job_ids)
        self._new_loads[job_id] = LoadSpec(
            req_id=request.request_id,
            block_ids=state.block_ids[first:last],
            block_hashes=hashes,
            locs=plan.locs,
            is_async=is_async,
            grouping=state.hit_grouping or self.key_space.num_shards,
            wait_s=HANDOFF_WAIT_S if handoff is not None else 0.0,
            pools=plan.pools,
            placements=plan.placements,
        )
        self._jobs[job_id] = _Job(
            req_id=request.request_id,
            is_store=False,
            first_block=first,
            block_ids=state.block_ids[first:last],
            block_hashes=hashes,
            pending=self.world_size,
        )
        state.load_job = job_id
        state.load_is_async = is_async
        if handoff is None:  # a handoff's load waits for the prefill's puts: not a figure
            self.pricing.planned(job_id, plan.locs, num_external_tokens)
        # Hits are not stored again; a failed load lowers this (update_connector_output).
        state.num_planned_blocks = max(state.num_planned_blocks, last)
        self.hit_tokens += num_external_tokens
        if state.hit_grouping not in (0, self.key_space.num_shards):
            self.cross_tp_hit_tokens += num_external_tokens

    # ---------------------------------------------------------------- stores
    def _plan_store(self, state: _RequestState, upto_blocks: int, *, finish: bool = False) -> bool:
        """Store jobs (each fitting staging) for blocks [planned, upto) kvray does not hold."""
        first = state.num_planned_blocks
        if upto_blocks <= first:
            return False
        state.num_planned_blocks = upto_blocks
        req = state.request
        hashes = [bytes(h) for h in req.block_hashes[first:upto_blocks]]
        present = self.manager.present(hashes)
        idx = [first + i for i, h in enumerate(hashes) if h not in self._storing and not present[i]]
        step = self.max_store_blocks
        planned = False
        for a in range(0, len(idx), step):
            planned |= self._store_job(state, idx[a : a + step], finish) is not None
        return planned

    def _store_job(self, state: _RequestState, idx: list[int], finish: bool) -> JobId | None:
        if not idx:
            return None
        req = state.request
        bs = self.block_size
        hashes = [bytes(req.block_hashes[i]) for i in idx]
        block_ids = [state.block_ids[i] for i in idx]
        job_id = next(self._job_ids)
        self._new_stores[job_id] = StoreSpec(
            req_id=req.request_id, block_ids=block_ids, block_hashes=hashes, finish=finish
        )
        contiguous = idx == list(range(idx[0], idx[-1] + 1))
        for h in hashes:
            self._storing[h] = job_id
        tokens = req.all_token_ids[idx[0] * bs : (idx[-1] + 1) * bs] if contiguous else []
        self._jobs[job_id] = _Job(
            req_id=req.request_id,
            is_store=True,
            first_block=idx[0],
            block_ids=block_ids,
            block_hashes=hashes,
            pending=self.world_size,
            token_ids=list(tokens),
            parent_hash=bytes(req.block_hashes[idx[0] - 1]) if idx[0] > 0 else None,
        )
        return job_id

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVRayConnectorMetadata:
        """This step's loads (planned at allocation) and stores (blocks this step fills)."""
        block_state = scheduler_output.kv_connector_block_state
        self.handoffs.stepped()
        self.pricing.step(scheduler_output, self._reqs)
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            state = self._reqs.get(req_id)
            if state is None:
                continue
            if block_state is not None:
                ids = block_state.get_block_ids(req_id)
                if ids is not None:
                    state.block_ids = list(ids[0])
            req = state.request
            # A handoff's first step: the one after its async load, or the one its sync load
            # runs in (the forward computes the rest of the prompt right after it).
            loaded = state.load_job is None or not state.load_is_async
            if state.handoff is not None and loaded and not state.handoff_begun:
                state.handoff_begun = True
                self.handoffs.began(state.handoff, req.num_prompt_tokens - req.num_computed_tokens)
            # num_computed_tokens is advanced after this call: add this step's tokens.
            computed = req.num_computed_tokens + num_new
            full = min(len(req.block_hashes), computed // self.block_size, len(state.block_ids))
            # Prompt blocks are stored as they fill; decode blocks in batches (or at finish).
            decoding = req.num_computed_tokens >= req.num_prompt_tokens
            if not decoding or full - state.num_planned_blocks >= self.decode_store_blocks:
                self._plan_store(state, full)
        meta = KVRayConnectorMetadata(
            loads=self._new_loads,
            stores=self._new_stores,
            preempted_req_ids=set(scheduler_output.preempted_req_ids or ()),
        )
        self._new_loads = {}
        self._new_stores = {}
        return meta

    # ---------------------------------------------------------------- completions
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        invalid = set(output.invalid_block_ids or ())
        if invalid:
            self._on_invalid_blocks(invalid)
        if not isinstance(meta, KVRayWorkerMetadata):
            return
        self.counters = self.counters.add(meta.counters)
        self.pricing.loads_done(meta.counters.load_seconds, meta.completed_jobs)
        for job_id, n in meta.completed_jobs.items():
            job = self._jobs.get(job_id)
            if job is None:
                continue
            job.pending -= n
            job.failed += meta.failed_jobs.get(job_id, 0)
            if job.pending > 0:
                continue
            del self._jobs[job_id]
            state = self._reqs.get(job.req_id)
            if job.is_store:
                for h in job.block_hashes:
                    if self._storing.get(h) == job_id:
                        del self._storing[h]
                if job.failed == 0:
                    self.manager.complete_store(job.block_hashes, job.token_ids, job.parent_hash)
                elif state is not None:
                    # Some rank could not store: let a later step try these blocks again.
                    state.num_planned_blocks = min(state.num_planned_blocks, job.first_block)
            elif state is not None and state.load_job == job_id:
                state.load_job = None

    def _on_invalid_blocks(self, invalid: set[int]) -> None:
        """Blocks a load failed to fill are recomputed by vLLM: plan to store them again."""
        for job in self._jobs.values():
            if job.is_store:
                continue
            bad = [i for i, b in enumerate(job.block_ids) if b in invalid]
            if not bad:
                continue
            self.quarantine.add(job.block_hashes[bad[0] :])
            state = self._reqs.get(job.req_id)
            if state is not None:
                state.num_planned_blocks = min(state.num_planned_blocks, job.first_block + bad[0])

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Store the last full blocks of a finished request, keeping them until it is done."""
        from vllm.v1.request import RequestStatus

        state = self._reqs.pop(request.request_id, None)
        if state is None or (state.load_job is not None and state.load_is_async):
            # An async load may still be writing these blocks: they hold nothing to store.
            return False, None
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return False, None
        state.block_ids = list(block_ids)
        full = min(
            len(request.block_hashes),
            request.num_computed_tokens // self.block_size,
            len(state.block_ids),
        )
        planned = self._plan_store(state, full, finish=True)
        if (
            not wants_handoff(request.kv_transfer_params)
            or request.status == RequestStatus.FINISHED_ABORTED
        ):
            return planned, None
        # A prefill for a remote decode keeps its blocks until its stores are owned by a pool.
        in_flight = any(j.is_store and j.req_id == request.request_id for j in self._jobs.values())
        held = hold_until_stored(
            request.request_id, self._new_stores, in_flight, self._add_empty_store
        )
        return held, self.handoffs.params([bytes(h) for h in request.block_hashes], full)

    def _add_empty_store(self, spec: StoreSpec) -> None:
        job_id = next(self._job_ids)
        self._new_stores[job_id] = spec
        self._jobs[job_id] = _Job(spec.req_id, True, 0, [], [], pending=self.world_size)

    # ---------------------------------------------------------------- events
    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.manager.take_events()

    # ---------------------------------------------------------------- introspection
    @property
    def store(self) -> ViewStore:
        """The (subscribed) store client the manager looks up in."""
        return self.manager.store

    def num_pending_jobs(self) -> int:
        return len(self._jobs)

    def num_tracked_requests(self) -> int:
        return len(self._reqs)

    def shutdown(self) -> None:
        self._reqs.clear()
        self._jobs.clear()
        self._storing.clear()
