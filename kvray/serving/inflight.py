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

import math
import threading
from collections import deque
from collections.abc import Sequence

from kvray.config import ConfigError

__all__ = ["InFlight"]

#: How long a routed prompt's blocks count as held by the replica it went to.
TTL_S = 3.0
#: (block, replica) entries kept at most.
MAX_BLOCKS = 1 << 17


class InFlight:
    """Blocks recently routed to each replica (by replica key), expiring after ``ttl_s``."""

    def __init__(self, ttl_s: float = TTL_S, max_blocks: int = MAX_BLOCKS) -> None:
        """``ttl_s``: the router's ``inflight_s`` (a ConfigError names it when invalid)."""
        number = not isinstance(ttl_s, bool) and isinstance(ttl_s, int | float)
        if not number or not 0 <= ttl_s < math.inf:
            raise ConfigError("inflight_s", ttl_s, "expected a finite number >= 0")
        if max_blocks < 1:
            raise ValueError(f"InFlight(max_blocks={max_blocks}): expected at least 1")
        self.ttl_s = float(ttl_s)
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
