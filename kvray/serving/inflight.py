"""What a router sent where, for the moments before any cache can say so.

A prompt routed to a replica is not in that replica's engine tier until the engine has
scheduled it (its blocks are then reported within milliseconds), nor in kvray until its
prefill is stored (a second or more on a busy CPU). Requests sharing a prefix that arrive in
between (a burst of conversations behind one system prompt, a client fanning out) would each
look cold, go to different replicas and compute the same prefix several times over. Measured on
Ray's multi-turn benchmark (8 sessions starting together, 4 replicas): first turns computed
709 prompt tokens each against 264 for later turns: 4 copies of the shared 896-token
system prompt computed at once.

:class:`InFlight` remembers, for ``ttl_s`` after routing, which replica each block of a routed
prompt went to; the router counts a replica's leading blocks here like blocks in its engine
cache (vLLM shares a prefix already scheduled on the same engine: its blocks enter the prefix
cache when they are allocated). It remembers the replica the router ranked first: should Serve
place the request on the next one (the first at its ``max_ongoing_requests``), the memory is
wrong about it for ``ttl_s`` at most, as it is about a replica that died. Bounded: at most
``max_blocks`` (block, replica) entries, oldest dropped first; entries expire after ``ttl_s``.
Thread-safe (one lock, no I/O under it).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvray.config import check_number

__all__ = ["InFlight", "Unsent"]

#: How long a routed prompt's blocks count as held by the replica it went to.
TTL_S = 3.0
#: (block, replica) entries kept at most.
MAX_BLOCKS = 1 << 17


class InFlight:
    """Blocks recently routed to each replica (by replica key), expiring after ``ttl_s``."""

    def __init__(self, ttl_s: float = TTL_S, max_blocks: int = MAX_BLOCKS) -> None:
        """``ttl_s``: the router's ``inflight_s`` (a ConfigError names it when invalid)."""
        ttl = check_number(ttl_s, "inflight_s", unit="seconds")
        if max_blocks < 1:
            raise ValueError(f"InFlight(max_blocks={max_blocks}): expected at least 1")
        self.ttl_s = ttl
        self.max_blocks = int(max_blocks)
        self._lock = threading.Lock()
        #: block id -> replica key -> expiry (monotonic seconds)
        self._holders: dict[int, dict[str, float]] = {}
        #: (expiry, block id, replica key) in the order noted: pruning and the bound
        self._order: deque[tuple[float, int, str]] = deque()

    def __len__(self) -> int:
        return len(self._order)

    def note(self, replica: str, ids: Sequence[int], now: float) -> None:
        """``ids`` (a prompt's full blocks, in order) were just routed to ``replica``."""
        if not self.ttl_s or not ids:
            return
        expiry = now + self.ttl_s
        with self._lock:
            self._prune(now)
            for i in ids:
                self._holders.setdefault(i, {})[replica] = expiry
                self._order.append((expiry, i, replica))
            while len(self._order) > self.max_blocks:
                self._drop(*self._order.popleft())

    def prefix(self, ids: Sequence[int], now: float) -> dict[str, int]:
        """Per replica, how many leading blocks of ``ids`` were routed to it and not expired."""
        out: dict[str, int] = {}
        if not self.ttl_s:
            return out
        with self._lock:
            alive: set[str] | None = None
            for k, i in enumerate(ids):
                held = self._holders.get(i)
                if not held:
                    break
                cur = {r for r, exp in held.items() if exp > now}
                alive = cur if alive is None else alive & cur
                if not alive:
                    break
                for r in alive:
                    out[r] = k + 1
        return out

    def _prune(self, now: float) -> None:
        order = self._order
        while order and order[0][0] <= now:
            self._drop(*order.popleft())

    def _drop(self, expiry: float, i: int, replica: str) -> None:
        held = self._holders.get(i)
        if held is None or held.get(replica) != expiry:
            return  # noted again since: a later entry owns it
        del held[replica]
        if not held:
            del self._holders[i]


#: How long a routing decision counts in its replica's queue at most before Serve sends it.
UNSENT_S = 1.0
#: Decisions awaiting Serve kept at most (the busiest replica's oldest dropped first).
MAX_UNSENT = 1 << 12


class Unsent:
    """Requests the router ranked first on a replica that Serve has not counted there yet.

    Serve counts a request in a replica's queue once it sends it (``on_send_request``) or the
    replica answers with its count (``on_new_queue_len_info``: accepting or refusing it, or
    reserving a slot for ``choose_replica``), after ``choose_replicas`` returns and its routing
    task gets to the request; requests routed concurrently in between (a burst) all saw the
    same counts. Measured on Ray's multi-turn benchmark (8 sessions starting together, 4
    replicas): five of the first eight requests went to one replica while it showed a queue of
    0, 0, 2, 0, 0, and two replicas got none. The router adds its decisions to Serve's counts
    until Serve counts them: a send marks the replica's oldest unsent decision sent (Serve's
    +1 replaces it), the replica's answer settles its oldest decision; a decision Serve never
    acts on there (the request went to the next rank) expires after ``ttl_s``. Bounded
    (``max_entries``), thread-safe (one lock, no I/O under it)."""

    def __init__(self, ttl_s: float = UNSENT_S, max_entries: int = MAX_UNSENT) -> None:
        self.ttl_s = float(ttl_s)
        self.max_entries = int(max_entries)
        self._lock = threading.Lock()
        #: replica key -> its decisions, oldest first
        self._by_replica: dict[str, _Decisions] = {}
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def chosen(self, replica: str, now: float) -> None:
        """The router just ranked ``replica`` first for a request."""
        with self._lock:
            self._expire(replica, now)
            self._by_replica.setdefault(replica, _Decisions()).expiries.append(now + self.ttl_s)
            self._n += 1
            if self._n > self.max_entries:
                self._settle(max(self._by_replica, key=lambda k: len(self._by_replica[k].expiries)))

    def sent(self, replica: str) -> None:
        """Serve sent a request to ``replica`` and added it to its count."""
        with self._lock:
            d = self._by_replica.get(replica)
            if d is not None and d.sent < len(d.expiries):
                d.sent += 1

    def answered(self, replica: str) -> None:
        """``replica`` told Serve its count of requests (the decision's request included)."""
        with self._lock:
            self._settle(replica)

    def pending(self, replica: str, now: float) -> int:
        """Decisions for ``replica`` that Serve has not counted and that have not expired."""
        with self._lock:
            self._expire(replica, now)
            d = self._by_replica.get(replica)
            return 0 if d is None else len(d.expiries) - d.sent

    def _settle(self, replica: str) -> None:
        """Drop ``replica``'s oldest decision (sent ones are the oldest)."""
        d = self._by_replica.get(replica)
        if d is None:
            return
        d.expiries.popleft()
        d.sent = max(0, d.sent - 1)
        self._n -= 1
        if not d.expiries:
            del self._by_replica[replica]

    def _expire(self, replica: str, now: float) -> None:
        d = self._by_replica.get(replica)
        while d is not None and d.expiries[0] <= now:
            self._settle(replica)
            d = self._by_replica.get(replica)


@dataclass
class _Decisions:
    """One replica's decisions awaiting Serve: their expiries, oldest first, and how many of
    the oldest Serve has sent (a send takes the oldest unsent one)."""

    expiries: deque[float] = field(default_factory=deque)
    sent: int = 0
