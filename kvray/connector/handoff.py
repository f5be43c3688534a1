"""Prefill/decode handoff through kvray, without the feed.

A prefill engine gets a request whose ``kv_transfer_params`` ask for a remote decode
(``do_remote_decode``, Ray Serve LLM's P/D protocol). When it finishes, the connector's
``request_finished`` returns :func:`handoff_params`: how many leading prompt blocks the decode
may load, the chained hash of the last one (it names them all: vLLM's block hashes chain), the
fingerprint of the key prefix (model, dtype, block size, layout...) and where each block is:
the pools holding every shard, from the prefill's view for blocks kvray already held and the
prefill's own node pool for the blocks its workers are storing now.

The decode engine's ``get_num_new_matched_tokens`` reads the params (:func:`read_handoff`) and
offers those blocks at once, loaded from the named pools in the engine's load mode: it never
consults its view of the index, so a feed that lags (or is paused) does not delay it. In the
default ``sync`` mode the load runs in the step that schedules the request, whose forward then
computes the rest of the prompt and samples the first token: one engine step sooner than an
async load, which takes a step to report. Blocks still being put by the prefill are waited
for, bounded by :data:`HANDOFF_WAIT_S` (an async load) or the step's load deadline (a sync
one, ``load_timeout_s`` and the bytes' time); a block missing past that (evicted, pool lost,
prefill killed before its put) is reported failed and recomputed by vLLM.

Params a decode cannot read (another model or layout, another block size, garbage, a hash
chain that is not this request's prompt) are ignored with a warning: the request is computed
in full. The keys loaded are always derived from the decode request's own block hashes and
its own key prefix, so params can make a load miss but never load another prompt's KV.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvray.connector.keyspace import EngineKeySpace
from kvray.connector.manager import LoadPlan
from kvray.connector.metadata import JobId, ReqId, StoreSpec
from kvray.meta.holders import MAX_POOLS, PLACEMENT_BASE, decode_slots, split_positions
from kvray.meta.view import LocalView
from kvray.metrics.tally import HandoffMetrics

logger = logging.getLogger(__name__)

__all__ = [
    "HANDOFF_KEY",
    "HANDOFF_WAIT_S",
    "Handoff",
    "HandoffError",
    "HandoffPlanner",
    "Locator",
    "fingerprint",
    "handoff_params",
    "hold_until_stored",
    "read_handoff",
    "wants_handoff",
]

#: The key of kvray's entry in ``kv_transfer_params``.
HANDOFF_KEY = "kvray"
VERSION = 1
#: How long a decode waits for blocks the prefill is still putting (then: recompute them).
HANDOFF_WAIT_S = 2.0
#: Most blocks one handoff names (a longer prompt hands off its first blocks only).
MAX_HANDOFF_BLOCKS = 1 << 16
#: Most pools one handoff names.
MAX_HANDOFF_POOLS = 256


class HandoffError(ValueError):
    """``kv_transfer_params`` this decode engine cannot use (the request is recomputed)."""


def fingerprint(key_space: EngineKeySpace, grouping: int = 0) -> str:
    """What must match between prefill and decode: the key prefix of ``grouping`` shards."""
    return hashlib.sha256(key_space.prefix_for(grouping)).hexdigest()[:32]


def wants_handoff(params: object) -> bool:
    """True for a prefill request of Ray's P/D protocol (``do_remote_decode``)."""
    return isinstance(params, dict) and params.get("do_remote_decode") is True


@dataclass(frozen=True)
class Handoff:
    """What a decode engine read from a prefill's params."""

    num_blocks: int
    grouping: int
    pools: list[str]
    #: Per run of blocks: (count, pool index of each shard).
    runs: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    #: When the prefill finished (its ``time.time()``; None: not said).
    sent_at: float | None = None

    def shard_pools(self, block: int) -> tuple[int, ...]:
        for count, where in self.runs:
            if block < count:
                return where
            block -= count
        raise IndexError(block)


def handoff_params(
    key_space: EngineKeySpace,
    view: LocalView,
    local_pool: str,
    block_hashes: Sequence[bytes],
    num_blocks: int,
) -> dict[str, Any]:
    """The prefill's ``kv_transfer_params`` naming its first ``num_blocks`` prompt blocks."""
    n = min(num_blocks, len(block_hashes), MAX_HANDOFF_BLOCKS)
    out: dict[str, Any] = {"do_remote_decode": False, "do_remote_prefill": False}
    if n <= 0:
        return out
    g = key_space.num_shards
    ids = key_space.block_ids(block_hashes[:n])
    locs = view.locs(ids)
    split = split_positions(locs)
    slots_by_shard = [
        decode_slots(locs, s, view.placements_of(ids[split], locs[split])).tolist()
        for s in range(g)
    ]
    names = view.pool_names()
    pools: list[str] = []
    runs: list[list[Any]] = []
    for b in range(n):
        where = []
        for s in range(g):
            # Not in the view (yet): this engine's workers are storing it in their node's pool.
            name = names.get(slots_by_shard[s][b], local_pool)
            if name not in pools:
                pools.append(name)
            where.append(pools.index(name))
        if runs and runs[-1][1] == where:
            runs[-1][0] += 1
        else:
            runs.append([1, where])
    out[HANDOFF_KEY] = {
        "v": VERSION,
        "fp": fingerprint(key_space),
        "g": g,
        "n": n,
        "last": bytes(block_hashes[n - 1]).hex(),
        "pools": pools,
        "runs": runs,
        "t": time.time(),
    }
    return out


def read_handoff(
    params: object, key_space: EngineKeySpace, block_hashes: Sequence[bytes]
) -> Handoff | None:
    """The handoff in a decode request's params (None: there is none); :class:`HandoffError`
    when there is one this engine cannot use."""
    if not isinstance(params, dict) or HANDOFF_KEY not in params:
        return None
    h = params[HANDOFF_KEY]
    if not isinstance(h, dict):
        raise HandoffError(f"{HANDOFF_KEY!r} is a {type(h).__name__}, not a mapping")
    if h.get("v") != VERSION:
        raise HandoffError(f"handoff version {h.get('v')!r}, this engine reads {VERSION}")
    g, n = h.get("g"), h.get("n")
    if not isinstance(g, int) or g not in key_space.groupings:
        raise HandoffError(f"grouping {g!r} is not readable here ({key_space.groupings})")
    if h.get("fp") != fingerprint(key_space, g):
        raise HandoffError("fingerprint differs: another model, dtype, block size or layout")
    if not isinstance(n, int) or not 0 < n <= MAX_HANDOFF_BLOCKS:
        raise HandoffError(f"block count {n!r}")
    if n > len(block_hashes) or h.get("last") != bytes(block_hashes[n - 1]).hex():
        raise HandoffError("the named blocks are not this request's prompt")
    pools = h.get("pools")
    if (
        not isinstance(pools, list)
        or not 0 < len(pools) <= MAX_HANDOFF_POOLS
        or not all(isinstance(p, str) and p for p in pools)
    ):
        raise HandoffError("pools: expected a list of pool names")
    runs: list[tuple[int, tuple[int, ...]]] = []
    total = 0
    for run in h.get("runs") or []:
        ok = isinstance(run, list) and len(run) == 2 and isinstance(run[0], int) and run[0] > 0
        where = run[1] if ok else None
        if not (
            isinstance(where, list)
            and len(where) == g
            and all(isinstance(i, int) and 0 <= i < len(pools) for i in where)
        ):
            raise HandoffError(f"run {run!r}")
        runs.append((run[0], tuple(where)))
        total += run[0]
    if total != n:
        raise HandoffError(f"runs cover {total} blocks, not {n}")
    t = h.get("t")
    sent_at = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None
    return Handoff(n, g, list(pools), runs, sent_at)


def hold_until_stored(
    req_id: ReqId,
    new_stores: Mapping[JobId, StoreSpec],
    stores_in_flight: bool,
    add_store: Callable[[StoreSpec], None],
) -> bool:
    """A prefill for a remote decode keeps its blocks until every store of the request is
    owned by a pool (not only gathered): its workers report it in ``finished_sending`` then.
    The request's final stores planned this step (``new_stores``) are marked ``hold``; with
    none, a final job with no blocks (``add_store``) waits for the stores already in flight.
    False: nothing to wait for (the blocks are freed at once)."""
    mine = [s for s in new_stores.values() if s.req_id == req_id and s.finish]
    for spec in mine:
        spec.hold = True
    if mine:
        return True
    if not stores_in_flight:
        return False
    add_store(StoreSpec(req_id, [], [], finish=True, hold=True))
    return True


class Locator:
    """Turns a handoff's pool names into the location codes and pool slots of a load plan.

    Pools the decode's view knows keep their slot; others get slots counted down from the top.
    Each plan carries its own pools and split blocks' slot tuples, so numbering need only hold
    within one plan: nothing is shared between the plans of a step."""

    def __init__(self, view: LocalView) -> None:
        self.view = view

    def slots(self, names: Sequence[str]) -> list[int]:
        """A pool slot for each name: the view's, or one counted down from the top."""
        known = {name: slot for slot, name in self.view.pool_names().items()}
        extra: dict[str, int] = {}
        out = []
        for name in names:
            slot = known.get(name)
            if slot is None:
                slot = extra.get(name)
                if slot is None:
                    slot = extra[name] = MAX_POOLS - 1 - len(extra)
            out.append(slot)
        return out

    def plan(self, handoff: Handoff, first: int, last: int) -> LoadPlan:
        """Where blocks [first, last) of the handoff are, as a :class:`LoadPlan`."""
        plan = LoadPlan([])
        slots = self.slots(handoff.pools)
        for b in range(first, last):
            where = tuple(slots[i] for i in handoff.shard_pools(b))
            for s in set(where):
                plan.pools[s] = handoff.pools[slots.index(s)]
            if len(set(where)) == 1:
                plan.locs.append(where[0] + 1)
                continue
            plan.locs.append(PLACEMENT_BASE)  # the plan carries the tuple itself
            plan.placements.append(where)
        return plan


class HandoffPlanner:
    """The scheduler side's handoffs: params out of a prefill, load plans into a decode."""

    #: Handoff latencies kept for tests and stats (the newest).
    MAX_LATENCIES = 1024

    def __init__(
        self, key_space: EngineKeySpace, view: LocalView, local_pool: str, namespace: str = ""
    ) -> None:
        self.key_space = key_space
        self.namespace = namespace
        self.view = view
        self.local_pool = local_pool
        self.locator = Locator(view)
        #: Figures (tests, stats): params returned by prefills; handoffs read by decodes;
        #: tokens offered from them; params ignored as unreadable.
        self.sent = 0
        self.received = 0
        self.offered_tokens = 0
        self.rejected = 0
        #: Handed-off requests the decode began computing; prompt tokens it computed for them
        #: (the rest loaded or in its own cache); prefill finished -> that first step done (s).
        self.begun = 0
        self.computed_tokens = 0
        self.latencies_s: deque[float] = deque(maxlen=self.MAX_LATENCIES)
        #: Prefill finished -> this scheduler first saw the request (s; the newest).
        self.arrivals_s: deque[float] = deque(maxlen=self.MAX_LATENCIES)
        self._stepping: list[float] = []

    def refuse(self, params: object, why: str) -> None:
        """A request's handoff (if its params carry one) this engine does not take (``why``):
        counted in ``rejected`` and said; the request's prefix is looked up like any other's."""
        if isinstance(params, dict) and HANDOFF_KEY in params:
            self.rejected += 1
            logger.warning("kvray: ignoring the handoff of a request (%s)", why)

    def read(self, params: object, block_hashes: Sequence[bytes]) -> Handoff | None:
        try:
            handoff = read_handoff(params, self.key_space, block_hashes)
        except HandoffError as e:
            self.rejected += 1
            logger.warning(
                "kvray: ignoring the handoff of a request (its prefix is looked up as any "
                "request's: loaded where kvray holds it, else computed): %s",
                e,
            )
            return None
        except Exception as e:  # garbage of any shape is the same: recompute
            self.rejected += 1
            logger.warning(
                "kvray: unreadable handoff params, ignored (its prefix is looked up as any "
                "request's): %s: %s",
                type(e).__name__,
                e,
            )
            return None
        if handoff is not None:
            self.received += 1
            if handoff.sent_at is not None:
                seconds = max(0.0, time.time() - handoff.sent_at)
                self.arrivals_s.append(seconds)
                if self.namespace:
                    HandoffMetrics.get(self.namespace).arrived(seconds)
        return handoff

    def params(self, block_hashes: Sequence[bytes], num_blocks: int) -> dict[str, Any]:
        self.sent += 1
        return handoff_params(self.key_space, self.view, self.local_pool, block_hashes, num_blocks)

    def began(self, handoff: Handoff, computed_tokens: int) -> None:
        """The decode engine schedules its first step over a handed-off request (its load is
        done): it computes ``computed_tokens`` of the prompt itself."""
        self.begun += 1
        self.computed_tokens += computed_tokens
        if self.namespace:
            HandoffMetrics.get(self.namespace).began(computed_tokens)
        if handoff.sent_at is not None:
            self._stepping.append(handoff.sent_at)

    def stepped(self) -> None:
        """The engine schedules its next step: the last one, which sampled the first token of
        the requests :meth:`began` then, is done (vLLM's engine loop takes its output first).
        Prefill and decode clocks are compared: on separate machines, their skew adds in."""
        if not self._stepping:
            return
        now = time.time()
        for sent in self._stepping:
            seconds = max(0.0, now - sent)
            self.latencies_s.append(seconds)
            if self.namespace:
                HandoffMetrics.get(self.namespace).observe(seconds)
        self._stepping.clear()
