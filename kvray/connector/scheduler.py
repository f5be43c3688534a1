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
from kvray.connector.groups import FULL, CacheGroup, deciding
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
from kvray.connector.sightings import Sightings

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


#: Why a hybrid model's decode engine does not load a prefill's handoff (it computes instead).
HYBRID_NO_HANDOFF = "a hybrid model's engine takes no P/D handoffs yet (issue 34)"

#: vLLM's null block (its block pool's first): a sliding-window block vLLM freed or skipped.
NULL_BLOCK_ID = 0


@dataclass
class _RequestState:
    request: Request
    #: The request's current paged-cache block ids, one list per KV cache group.
    block_ids: tuple[list[int], ...] = ([],)
    #: Full-attention blocks [0, n) are in kvray, being stored, or were hits: never planned
    #: again.
    num_planned_blocks: int = 0
    #: Locally computed tokens the last ``get_num_new_matched_tokens`` was told about.
    num_local_tokens: int = 0
    #: The load of its hit (one job per group), until every rank reported it.
    load_jobs: set[JobId] = field(default_factory=set)
    load_is_async: bool = False
    #: Sliding-window groups: the block counts a later hit can end at (the window before each
    #: is stored once computed), and the blocks planned so far, per group.
    anchors: set[int] = field(default_factory=set)
    window_planned: dict[int, set[int]] = field(default_factory=dict)
    #: State groups: the blocks below this were looked at for states to store, per group.
    states_scanned: dict[int, int] = field(default_factory=dict)
    prompt_anchored: bool = False
    #: The grouping the last lookup found the hit in (the next load reads it).
    hit_grouping: int = 0
    #: A prefill's handoff this (decode) request loads from (:mod:`.handoff`), once read.
    handoff: Handoff | None = None
    handoff_read: bool = False
    handoff_begun: bool = False
    #: Its hit was priced and found cheaper to compute (declines count once a request).
    declined: bool = False
    #: Its blocks were found not worth storing (counted once a request).
    save_declined: bool = False
    #: Its prompt tokens left to compute were measured (once, at its first allocation).
    seen: bool = False
    #: With ``store_seen_only``: its leading blocks an earlier prompt on this engine had too
    #: (the only ones stored), once its prompt was sighted.
    sighted_blocks: int = -1
    unseen_skipped: int = 0
    #: With ``store_seen_only="auto"``: its first sightings are stored too (they pay).
    store_first: bool = False


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
    #: The KV cache group (vLLM's index) and, for sliding-window stores, the block indices.
    group: int = 0
    indices: list[int] = field(default_factory=list)


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
        groups: tuple[CacheGroup, ...] = (),
        managers: dict[int, CacheManager] | None = None,
    ) -> None:
        """``groups``/``managers``: a hybrid model's KV cache groups and a manager for each
        (vLLM's group index); none for one group (``key_space`` and ``manager`` are it)."""
        self.config = config
        self.key_space = key_space
        self.manager = manager
        if not groups:
            groups = (CacheGroup(0, FULL, key_space, ()),)
        self.groups = groups
        self._main = deciding(groups).index
        self.managers: dict[int, CacheManager] = {**(managers or {}), self._main: manager}
        self._full = [g for g in groups if not g.windowed]
        #: Groups a hit needs only the last blocks of (sliding windows, states).
        self._windows = [g for g in groups if g.windowed]
        self._sliding = [g for g in self._windows if not g.is_state]
        self._states = [g for g in self._windows if g.is_state]
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
        self._storing: dict[tuple[int, bytes], JobId] = {}
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
        #: Blocks are stored only once an earlier prompt had them (config ``store_seen_only``;
        #: ``auto``: unless a first sighting's store pays, by
        #: :meth:`~kvray.connector.pricing.Pricing.first_sightings_pay`).
        self.sightings = Sightings() if config.store_seen_only else None
        self.seen_only_auto = config.store_seen_only == "auto"
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
        if self.sightings is not None and state.sighted_blocks < 0:
            state.sighted_blocks = self.sightings.sight(
                request.block_hashes, num_computed_tokens // bs
            )
            if self.seen_only_auto:
                first = len(request.block_hashes) - state.sighted_blocks
                reuse = self.sightings.reuse_of(continued=state.sighted_blocks > 0)
                state.store_first = self.pricing.first_sightings_pay(reuse, first * bs)
        max_blocks = min(len(request.block_hashes), request.num_tokens // bs)
        start = num_computed_tokens // bs
        if max_blocks <= start:
            return 0, False
        hashes = list(request.block_hashes[:max_blocks])
        if not state.handoff_read:  # a prefill's: load where they say
            state.handoff_read = True
            if self._windows:
                self.handoffs.refuse(request.kv_transfer_params, HYBRID_NO_HANDOFF)
            else:
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
        if self._windows and hit_blocks > start:
            stored = hit_blocks
            hit_blocks = self._window_hit(request, hashes, start, hit_blocks, state.hit_grouping)
            if hit_blocks < stored:  # the next request sharing this prefix stops there too
                state.anchors.add(stored)
        if hit_blocks <= start:
            return 0, False
        num_tokens = _hit_tokens(request, hit_blocks * bs) - num_computed_tokens
        return num_tokens, self._load_async

    def _window_hit(
        self, request: Request, hashes: list[bytes], start: int, end: int, grouping: int
    ) -> int:
        """Where a hit of full-attention blocks [start, end) stops so that every
        sliding-window group holds the blocks it needs before the hit's end (``start``: none)."""
        present = {
            g.index: self.managers[g.index]
            .store.local_view()
            .contains(g.key_space.block_ids(hashes[start:end], grouping))
            for g in self._windows
        }
        n = end
        while n > start:
            m = n
            for g in self._windows:
                m = min(m, self._window_end(g, request, present[g.index], start, m))
            if m == n:
                break
            n = m
        return n

    def _window_end(
        self, group: CacheGroup, request: Request, present: np.ndarray, start: int, end: int
    ) -> int:
        """The last hit end in (start, end] whose window of ``group`` is present."""
        bs = self.block_size
        for m in range(end, start, -1):
            tokens = _hit_tokens(request, m * bs)
            if not group.can_end(tokens):
                continue
            a = max(start, group.need_from(tokens))
            if present[a - start : m - start].all():
                return m
        return start

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
        state.block_ids = tuple(list(ids) for ids in blocks.get_block_ids())
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
        state.load_jobs = set()
        for group in self.groups:
            ids = state.block_ids[group.index]
            if group.index == self._main:
                idx, group_plan = list(range(first, last)), plan
            else:  # a sliding window's skipped blocks are null: nothing to load into them
                held = blocks.blocks[group.index]
                idx = [i for i in range(first, last) if not held[i].is_null]
                group_plan = self.managers[group.index].prepare_load(
                    [hashes[i - first] for i in idx], state.hit_grouping
                )
            if not idx:
                continue
            job_id = next(self._job_ids)
            self._new_loads[job_id] = LoadSpec(
                req_id=request.request_id,
                block_ids=[ids[i] for i in idx],
                block_hashes=[hashes[i - first] for i in idx],
                locs=group_plan.locs,
                is_async=is_async,
                grouping=state.hit_grouping or group.key_space.num_shards,
                wait_s=HANDOFF_WAIT_S if handoff is not None else 0.0,
                pools=group_plan.pools,
                placements=group_plan.placements,
                group=group.index,
            )
            self._jobs[job_id] = _Job(
                req_id=request.request_id,
                is_store=False,
                first_block=idx[0],
                block_ids=[ids[i] for i in idx],
                block_hashes=[hashes[i - first] for i in idx],
                pending=self.world_size,
                group=group.index,
            )
            state.load_jobs.add(job_id)
            if handoff is None and group.index == self._main:  # a handoff's: not a figure
                self.pricing.planned(job_id, plan.locs, num_external_tokens)
        state.load_is_async = is_async
        # Hits are not stored again; a failed load lowers this (update_connector_output).
        state.num_planned_blocks = max(state.num_planned_blocks, last)
        self.hit_tokens += num_external_tokens
        if state.hit_grouping not in (0, self.key_space.num_shards):
            self.cross_tp_hit_tokens += num_external_tokens

    # ---------------------------------------------------------------- stores
    def _plan_store(self, state: _RequestState, upto_blocks: int, *, finish: bool = False) -> bool:
        """Store jobs (each fitting staging) for full-attention blocks [planned, upto) kvray
        does not hold, and the windows of sliding-window groups before anchors reached.
        Nothing is planned while a later hit of the request's prefix would not pay to load
        (:meth:`_worth_storing`, asked only when there are new blocks to plan); what is not
        planned stays to be planned at a later step."""
        if upto_blocks > state.num_planned_blocks and not self._worth_storing(state, upto_blocks):
            return False
        upto_blocks = self._sighted(state, upto_blocks)
        planned = self._plan_windows(state, upto_blocks, finish) if self._sliding else False
        planned |= self._plan_states(state, upto_blocks, finish) if self._states else False
        first = state.num_planned_blocks
        if upto_blocks <= first:
            return planned
        state.num_planned_blocks = upto_blocks
        req = state.request
        hashes = [bytes(h) for h in req.block_hashes[first:upto_blocks]]
        step = self.max_store_blocks
        for group in self._full:
            g = group.index
            present = self.managers[g].present(hashes)
            idx = [
                first + i
                for i, h in enumerate(hashes)
                if (g, h) not in self._storing and not present[i]
            ]
            for a in range(0, len(idx), step):
                planned |= self._store_job(state, idx[a : a + step], finish, g) is not None
        return planned

    def _worth_storing(self, state: _RequestState, upto_blocks: int) -> bool:
        """With ``price_loads``, a request's blocks are stored only while a later hit of its
        prefix up to ``upto_blocks`` would be loaded from this node's pool by this engine's
        costs (where recomputing a prefix beats loading it, storing it costs the engine's
        cores for nothing). A prefill's blocks for a remote decode are always stored."""
        if not self.price_loads or wants_handoff(state.request.kv_transfer_params):
            return True
        if self.pricing.worth_storing(upto_blocks * self.block_size):
            return True
        if not state.save_declined:
            state.save_declined = True
            self.pricing.saves_declined += 1
            self.store.count(saves_declined=1)
        return False

    def _sighted(self, state: _RequestState, upto_blocks: int) -> int:
        """With ``store_seen_only``, the blocks below ``upto_blocks`` an earlier prompt on this
        engine had too (all of them for a prefill's blocks a remote decode loads)."""
        if (
            self.sightings is None
            or state.store_first
            or wants_handoff(state.request.kv_transfer_params)
        ):
            return upto_blocks
        keep = min(upto_blocks, max(state.sighted_blocks, state.num_planned_blocks))
        more = upto_blocks - keep - state.unseen_skipped
        if more > 0:
            state.unseen_skipped += more
            self.sightings.skipped_blocks += more
            self.store.count(unseen_skipped=more)
        return keep

    def _plan_windows(self, state: _RequestState, upto_blocks: int, finish: bool) -> bool:
        """Sliding-window groups store the window before each anchor computed so far (blocks
        vLLM still holds; the window of an anchor is held while its last block is computed)."""
        req = state.request
        if not state.prompt_anchored:  # a request repeating this prompt hits up to its end
            state.prompt_anchored = True
            state.anchors.add(min(len(req.block_hashes), req.num_prompt_tokens // self.block_size))
        reached = sorted(n for n in state.anchors if 0 < n <= upto_blocks)
        if not reached:
            return False
        state.anchors.difference_update(reached)
        planned = False
        for group in self._sliding:
            want = sorted({i for n in reached for i in group.window_blocks(n)})
            planned |= self._plan_group(state, group, want, finish)
        return planned

    def _plan_states(self, state: _RequestState, upto_blocks: int, finish: bool) -> bool:
        """State groups store every state vLLM materialized below ``upto_blocks`` and still
        holds: its non-null blocks there (block ``p`` holds the state after exactly
        ``(p + 1) * block_size`` tokens once that many are computed, vLLM's invariant)."""
        planned = False
        for group in self._states:
            ids = state.block_ids[group.index]
            upto = min(upto_blocks, len(ids))
            scanned = state.states_scanned.get(group.index, 0)
            if upto <= scanned:
                continue
            state.states_scanned[group.index] = upto
            want = [i for i in range(scanned, upto) if ids[i] != NULL_BLOCK_ID]
            planned |= self._plan_group(state, group, want, finish)
        return planned

    def _plan_group(
        self, state: _RequestState, group: CacheGroup, want: list[int], finish: bool
    ) -> bool:
        """Store jobs for blocks ``want`` of a windowed group: those vLLM still holds, not
        planned before for this request, not stored or being stored."""
        g = group.index
        done = state.window_planned.setdefault(g, set())
        ids = state.block_ids[g]
        want = [i for i in want if i not in done and i < len(ids) and ids[i] != NULL_BLOCK_ID]
        if not want:
            return False
        done.update(want)
        hashes = [bytes(state.request.block_hashes[i]) for i in want]
        present = self.managers[g].present(hashes)
        idx = [
            i
            for i, h, p in zip(want, hashes, present, strict=True)
            if (g, h) not in self._storing and not p
        ]
        planned = False
        step = self.max_store_blocks
        for a in range(0, len(idx), step):
            planned |= self._store_job(state, idx[a : a + step], finish, g) is not None
        return planned

    def _store_job(
        self, state: _RequestState, idx: list[int], finish: bool, group: int = 0
    ) -> JobId | None:
        if not idx:
            return None
        req = state.request
        bs = self.block_size
        hashes = [bytes(req.block_hashes[i]) for i in idx]
        block_ids = [state.block_ids[group][i] for i in idx]
        job_id = next(self._job_ids)
        self._new_stores[job_id] = StoreSpec(
            req_id=req.request_id,
            block_ids=block_ids,
            block_hashes=hashes,
            finish=finish,
            group=group,
        )
        contiguous = idx == list(range(idx[0], idx[-1] + 1))
        for h in hashes:
            self._storing[group, h] = job_id
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
            group=group,
            indices=list(idx),
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
                    state.block_ids = tuple(list(x) for x in ids)
            req = state.request
            # A handoff's first step: the one after its async load, or the one its sync load
            # runs in (the forward computes the rest of the prompt right after it).
            loaded = not state.load_jobs or not state.load_is_async
            if state.handoff is not None and loaded and not state.handoff_begun:
                state.handoff_begun = True
                self.handoffs.began(state.handoff, req.num_prompt_tokens - req.num_computed_tokens)
            # num_computed_tokens is advanced after this call: add this step's tokens.
            computed = req.num_computed_tokens + num_new
            full = min(
                len(req.block_hashes), computed // self.block_size, len(state.block_ids[self._main])
            )
            # Prompt blocks are stored as they fill; decode blocks in batches (or at finish).
            decoding = req.num_computed_tokens >= req.num_prompt_tokens
            if not decoding or full - state.num_planned_blocks >= self.decode_store_blocks:
                self._plan_store(state, full)
            elif self._states:  # a state vLLM frees two steps after decode materializes it
                self._plan_states(state, full, finish=False)
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
        self.pricing.stores_done(meta.counters.store_seconds, meta.counters.store_timed_blocks)
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
                    if self._storing.get((job.group, h)) == job_id:
                        del self._storing[job.group, h]
                if job.failed == 0:
                    self.managers[job.group].complete_store(
                        job.block_hashes, job.token_ids, job.parent_hash
                    )
                elif state is not None and job.group in state.window_planned:
                    state.window_planned[job.group].difference_update(job.indices)
                elif state is not None:
                    # Some rank could not store: let a later step try these blocks again.
                    state.num_planned_blocks = min(state.num_planned_blocks, job.first_block)
            elif state is not None:
                state.load_jobs.discard(job_id)
                if job.failed and len(self.groups) > 1:
                    self._on_failed_load(job, state)

    def _on_failed_load(self, job: _Job, state: _RequestState) -> None:
        """A hybrid model's load some rank could not complete: vLLM got the request as a
        failed async load (blocks of several groups cannot be named to it) and recomputes it
        from its start. Its blocks are not offered again for a while (the next lookup would
        offer the same hit), and what it recomputes is planned to be stored again."""
        self.quarantine.add(job.block_hashes)
        first = job.first_block
        state.num_planned_blocks = min(state.num_planned_blocks, first)
        for done in state.window_planned.values():
            done.difference_update(range(first, first + len(job.block_ids)))
        for g, scanned in state.states_scanned.items():
            state.states_scanned[g] = min(scanned, first)

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
                first_bad = job.first_block + bad[0]
                state.num_planned_blocks = min(state.num_planned_blocks, first_bad)
                for done in state.window_planned.values():  # recomputed: stored again
                    done.difference_update(range(first_bad, first_bad + len(job.block_ids)))

    def request_finished(
        self, request: Request, block_ids: list[int] | tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Store the last full blocks of a finished request, keeping them until it is done
        (``block_ids``: the one group's, or a tuple of every group's)."""
        from vllm.v1.request import RequestStatus

        state = self._reqs.pop(request.request_id, None)
        if state is None or (state.load_jobs and state.load_is_async):
            # An async load may still be writing these blocks: they hold nothing to store.
            return False, None
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return False, None
        state.block_ids = (
            tuple(list(x) for x in block_ids)
            if isinstance(block_ids, tuple)
            else (list(block_ids),)
        )
        full = min(
            len(request.block_hashes),
            request.num_computed_tokens // self.block_size,
            len(state.block_ids[self._main]),
        )
        state.anchors.add(full)  # the next turn of a conversation hits up to here
        planned = self._plan_store(state, full, finish=True)
        if self._windows:  # no handoffs for hybrid models (yet)
            return planned, None
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
