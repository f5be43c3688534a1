"""What the scheduler side measures of its own engine, and what it concludes (issue 32).

Fed only from what vLLM and kvray already report, no extra forward pass and no Ray call:

- **steps**: the wall time from one ``build_connector_meta`` to the next is a step (schedule,
  forward, outputs), unless every request of the step finished (the engine may then have
  waited for work); the loads a step ran inside it (``sync`` / ``layerwise``) are taken out,
  and the rest is fitted against the prompt tokens the step computed
  (:class:`~kvray.meta.costs.EngineCosts`);
- **loads**: each output's ``load_seconds`` (summed over ranks: divided by the world size)
  for the load jobs it completed, with the tier each came from (the pool on this engine's
  node, or another) and its tokens, as planned;
- **queue**: the prompt tokens not computed yet of every request the connector tracks;
- **stores**: what each store piece takes from the engine's process, per token: the engine
  thread's gather and hand-off, and the CPU its put threads spend copying it into Ray (not the
  wait for the pool's acknowledgement: the request never waits for a store); a decayed mean
  weighted by blocks, never published.

From them :meth:`Pricing.tokens_to_load` says how much of a hit pays to load, and
:attr:`Pricing.published` is what the engine tier's heartbeat carries to routers. Until the
engine's prefill is measured nothing is published and every hit is loaded (kvray's behaviour
before this module). One thread (the scheduler's) writes; ``published`` is an immutable tuple
replaced whole, read by the reporter's thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from kvray.meta.costs import Costs, Decayed, EngineCosts, tokens_to_load

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvray.meta.view import LocalView

__all__ = ["Pricing"]

#: The queue and the published estimates are refreshed at most this often (seconds).
REFRESH_S = 0.1
#: Load jobs remembered until their completion comes back (oldest dropped beyond).
MAX_JOBS = 4096


class Pricing:
    """One engine's cost estimates, kept by its scheduler-side connector."""

    def __init__(
        self,
        block_size: int,
        world_size: int,
        local_pool: str,
        view: Callable[[], LocalView] | None = None,
        *,
        loads_in_step: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.world_size = max(1, world_size)
        self.local_pool = local_pool
        self._view = view
        self.loads_in_step = loads_in_step
        self.clock = clock
        self.engine = EngineCosts()
        self.costs = Costs()
        #: Seconds a store takes from the engine's process per token (gather, hand-off, the
        #: put threads' CPU).
        self.store_s_per_token = Decayed()
        #: What the engine tier publishes (:meth:`Costs.to_wire`; empty until warm).
        self.published: tuple[float, ...] = ()
        self._prev: tuple[float, int, int, frozenset[str]] | None = None
        self._load_s = 0.0
        self._jobs: dict[int, tuple[str, int]] = {}
        self._refreshed = -math.inf
        self._local_slot: tuple[int, int] = (-1, -1)  # (id of the nodes table, slot)
        #: Figures: steps and loads measured, loads declined and the tokens recomputed instead.
        self.steps = 0
        self.loads = 0
        self.loads_declined = 0
        self.tokens_declined = 0
        #: Requests whose blocks were not stored (a later hit of them would not be loaded).
        self.saves_declined = 0

    # ------------------------------------------------------------ steps
    def step(self, so: SchedulerOutput, requests: Mapping[str, Any]) -> None:
        """A step is scheduled: the previous one ended now. ``requests``: the connector's
        requests by id (each with its vLLM ``request``)."""
        now = self.clock()
        prev = self._prev
        if prev is not None:
            t0, prefill, decodes, ids = prev
            if ids - set(so.finished_req_ids or ()):  # the engine had work: it did not idle
                self.engine.observe_step(prefill, now - t0 - self._load_s, now, decodes)
                self.steps += 1
        self._load_s = 0.0
        prefill = decodes = 0
        for req_id, n in so.num_scheduled_tokens.items():
            state = requests.get(req_id)
            req = getattr(state, "request", None)
            if req is None:
                continue
            if req.num_computed_tokens < req.num_prompt_tokens:
                prefill += min(n, req.num_prompt_tokens - req.num_computed_tokens)
            else:
                decodes += 1
        sched = so.num_scheduled_tokens
        self._prev = (now, prefill, decodes, frozenset(sched)) if sched else None
        if now - self._refreshed >= REFRESH_S:
            self._refresh(now, sched, requests)

    def _refresh(self, now: float, sched: Mapping[str, int], requests: Mapping[str, Any]) -> None:
        self._refreshed = now
        tokens = 0
        for req_id, state in requests.items():
            req = getattr(state, "request", None)
            if req is not None:
                left = req.num_prompt_tokens - req.num_computed_tokens - sched.get(req_id, 0)
                tokens += max(0, left)
        self.engine.set_queue(tokens, len(requests))
        self.costs = self.engine.costs(now)
        self.published = self.costs.to_wire() if self.costs.warm else ()

    def refresh_soon(self) -> None:
        """Refresh the queue and the published estimates at the next step."""
        self._refreshed = -math.inf

    @property
    def warm(self) -> bool:
        return self.costs.prefill_s_per_token is not None

    # ------------------------------------------------------------ loads
    def tier_of(self, locs: Iterable[int]) -> str:
        """``local`` when every block is whole in this node's pool, else ``remote``."""
        slot = self._local()
        codes = np.asarray(list(locs), dtype=np.int64)
        if slot >= 0 and codes.size and bool(np.all(codes == slot + 1)):
            return "local"
        return "remote"

    def runs(self, locs: np.ndarray) -> list[tuple[str, int]]:
        """The hit's consecutive (tier, tokens) runs from its blocks' location codes."""
        slot = self._local()
        local = (locs == slot + 1) if slot >= 0 else np.zeros(locs.shape, dtype=bool)
        out: list[tuple[str, int]] = []
        for is_local in local.tolist():
            tier = "local" if is_local else "remote"
            if out and out[-1][0] == tier:
                out[-1] = (tier, out[-1][1] + self.block_size)
            else:
                out.append((tier, self.block_size))
        return out

    def _local(self) -> int:
        """This engine's node's pool slot (-1: not known), cached per nodes table."""
        if self._view is None or not self.local_pool:
            return -1
        nodes = self._view().nodes
        if self._local_slot[0] != id(nodes):
            slot = next((s for s, n in nodes.items() if n.pool_name == self.local_pool), -1)
            self._local_slot = (id(nodes), slot)
        return self._local_slot[1]

    def tokens_to_load(self, locs: np.ndarray) -> int:
        """Of a hit whose blocks have location codes ``locs``, the leading tokens worth
        loading (all of them until the engine is measured)."""
        if not self.warm or not locs.size:
            return int(locs.size) * self.block_size
        return tokens_to_load(self.runs(locs), self.costs)

    def worth_storing(self, tokens: int) -> bool:
        """Whether a later hit of a prefix of ``tokens``, from this node's pool (the cheapest
        tier), would be loaded by this engine's measured costs. True until the prefill and the
        local load path are both measured: a store never measured is made (and a path whose
        samples decayed is tried again, as loads are)."""
        if not self.warm or tokens <= 0 or self.costs.load("local") is None:
            return True
        return tokens_to_load([("local", tokens)], self.costs) > 0

    def stores_done(self, seconds: float, blocks: int) -> None:
        """Store pieces of ``blocks`` blocks in all took ``seconds`` (summed) of the engine's
        process."""
        if blocks > 0 and seconds > 0:
            per = seconds / (blocks * self.block_size)
            self.store_s_per_token.observe(per, self.clock(), weight=float(blocks))

    def first_sightings_pay(self, reuse: float | None, tokens: int) -> bool:
        """``store_seen_only="auto"``: whether storing ``tokens`` a prompt holds for the
        first time pays, when a share ``reuse`` of such tokens is needed again beyond vLLM's
        own cache (:attr:`~kvray.connector.sightings.Sightings.reuse`).

        Stored now, every such token costs a store ``S`` and each one that comes back loads
        (``L``); not stored, the ones that come back are recomputed (``R``) and stored at
        that second sighting, and load after. So storing pays iff ``S x (1 - reuse) < reuse
        x (R - L)``, each priced by this engine's measurements at this size: ``S`` the store
        figure, ``L`` the local load line (either stands for the other while only one is
        measured: the same bytes cross the same path), ``R`` the prefill. Stored while the
        reuse, the prefill or both ``S`` and ``L`` are unmeasured (the doorkeeper closes only
        on evidence)."""
        now = self.clock()
        per = self.costs.prefill_s_per_token
        line = self.costs.load("local")
        store = self.store_s_per_token.value(now)
        if reuse is None or per is None or tokens <= 0 or (line is None and store is None):
            return True
        load_s = line.seconds(tokens) if line is not None else tokens * (store or 0.0)
        store_s = tokens * store if store is not None else load_s
        return store_s * (1.0 - reuse) < reuse * (tokens * per - load_s)

    def declined(self, tokens: int) -> None:
        """A hit (or its tail) of ``tokens`` left to vLLM to compute."""
        self.loads_declined += 1
        self.tokens_declined += tokens

    def planned(self, job_id: int, locs: Iterable[int], tokens: int) -> None:
        """A load job was planned (its completion is measured)."""
        if len(self._jobs) >= MAX_JOBS:
            self._jobs.pop(next(iter(self._jobs)))
        self._jobs[job_id] = (self.tier_of(locs), tokens)

    def forget(self, job_id: int) -> None:
        self._jobs.pop(job_id, None)

    def loads_done(self, load_seconds: float, job_ids: Iterable[int]) -> None:
        """An output's load seconds (summed over ranks) for the load jobs it completed."""
        wall = max(0.0, load_seconds) / self.world_size
        if self.loads_in_step:
            self._load_s += wall
        done = [self._jobs.pop(j) for j in job_ids if j in self._jobs]
        if not done or len({t for t, _ in done}) != 1:
            return  # nothing measured, or tiers mixed in one figure
        n = len(done)
        self.engine.observe_load(
            done[0][0], sum(k for _, k in done) // n, wall / n, self.clock(), n=n
        )
        self.loads += n

    def request_seen(self, tokens_to_compute: int) -> None:
        """A request's prompt tokens left to compute once its hits were found."""
        self.engine.observe_request(max(0, tokens_to_compute), self.clock())
