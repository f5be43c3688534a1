"""The engine's own KV cache, reported to kvray's index (the engine tier, for routers only).

Why vLLM's KV events and not the connector's view of allocations: the connector sees a
request's blocks allocated and freed, but a freed block stays in vLLM's prefix cache until the
block pool evicts it, which no connector hook reports; the block pool's ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` events say exactly what the cache holds. They are taken
where the scheduler already drains them (``BlockPool.take_events``, wrapped on the connector's
bound pool; events are switched on there when the user did not ask for them, and then not
passed on to vLLM's publisher): no ZMQ socket, no port per replica.

The scheduler's thread only appends the events to a list; a supervised thread replays them
into the set of held ids and sends each index shard its part of the net change, one call at a
time (in order), every few milliseconds, or an empty report (a heartbeat) every
:data:`~kvray.meta.engine_table.REPORT_INTERVAL_S`. Anything refused or lost makes the next report a
full one. On ``close`` the engine's entries are dropped at once; a killed engine's expire.
The queue is bounded (:data:`MAX_PENDING_BLOCKS`): a reporter that falls that far behind
clears this engine's entries and rebuilds them from later events, one that ended queues nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from kvray.meta.engine_table import REPLICA_ENV, REPORT_INTERVAL_S
from kvray.meta.ids import engine_ids, index_shard_of
from kvray.meta.messages import RAY_NAMESPACE, ReplicaInfo, index_name
from kvray.threads import SupervisedThread

logger = logging.getLogger(__name__)

__all__ = ["REPLICA_ENV", "EngineReporter"]

#: Least time between two reports: events of a few scheduler steps go out together.
MIN_GAP_S = 0.002
#: Longest an engine-tier call may take before the report counts as lost.
CALL_TIMEOUT_S = 5.0
#: Most block hashes queued for the reporter. Past it (the reporter stuck or gone) the queue is
#: dropped for one "cleared" mark: this engine's entries are emptied, not wrong, and events
#: after it rebuild them. A reporter that ended for good queues nothing.
MAX_PENDING_BLOCKS = 1 << 18

_STORED, _REMOVED, _CLEARED = 1, 0, 2


def replica_key() -> str:
    return os.environ.get(REPLICA_ENV) or f"{socket.gethostname()}:{os.getpid()}"


class EngineReporter:
    """Sends what one engine's KV cache holds to every index shard of a namespace."""

    def __init__(self, namespace: str, num_index_shards: int, node_id: str, key: str | None = None):
        self.namespace = namespace
        self.num_index_shards = num_index_shards
        self.key = key or replica_key()
        self.node_id = node_id
        self.incarnation = uuid.uuid4().hex
        self.slot = -1
        self.reports = 0
        self.failures = 0
        self._usage: Callable[[], float] = lambda: 0.0
        #: The engine's published cost estimates (:mod:`kvray.meta.costs`), read at each
        #: report: an immutable tuple the scheduler's thread replaces.
        self.costs: Callable[[], tuple[float, ...]] = tuple
        self._lock = threading.Lock()
        self._pending: list[tuple[int, list[Any]]] = []
        self._pending_blocks = 0
        self._ended = False
        self._held: set[int] = set()
        self._full = True
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._handles: list[Any] | None = None
        self._thread = SupervisedThread(
            self._run,
            "kvray-engine-tier",
            f"the engine tier reporter of {namespace!r}",
            stop=self._stop,
            restarts=3,
            backoff_s=0.5,
            on_restart=lambda e: self._resend(),
            on_exit=self._end,
        )

    # ------------------------------------------------------------ scheduler thread
    def install(self, block_pool: Any) -> None:
        """Take the block pool's KV events from now on, and start reporting."""
        user_wants = bool(block_pool.enable_kv_cache_events)
        block_pool.enable_kv_cache_events = True
        take = block_pool.take_events

        def take_events() -> list[Any]:
            events = take()
            if events:
                self.observe(events)
            return events if user_wants else []

        block_pool.take_events = take_events
        self._usage = block_pool.get_usage
        self._thread.start()

    def observe(self, events: list[Any]) -> None:
        """vLLM's events of a step (scheduler thread: only queued here)."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        batch: list[tuple[int, list[Any]]] = []
        for ev in events:
            if isinstance(ev, BlockStored | BlockRemoved):
                if ev.group_idx not in (None, 0):
                    continue  # one KV cache group is the routing signal
                op = _STORED if isinstance(ev, BlockStored) else _REMOVED
                batch.append((op, ev.block_hashes))
            elif isinstance(ev, AllBlocksCleared):
                batch.append((_CLEARED, []))
        if not batch:
            return
        n = sum(len(h) for _, h in batch)
        with self._lock:
            if self._ended:
                return
            if self._pending_blocks + n > MAX_PENDING_BLOCKS:
                if self._pending[:1] != [(_CLEARED, [])]:
                    logger.warning(
                        "kvray: the engine tier reporter fell %d blocks behind; this engine's "
                        "entries are cleared and rebuilt from its next events",
                        self._pending_blocks + n,
                    )
                self._pending, self._pending_blocks = [(_CLEARED, [])], 0
            self._pending.extend(batch)
            self._pending_blocks += n
        self._wake.set()

    def _end(self) -> None:
        """The reporter thread ended (stopped, Ray gone, or died for good): queue nothing,
        hold nothing (the held set was the thread's alone)."""
        with self._lock:
            self._ended = True
            self._pending, self._pending_blocks = [], 0
        self._held = set()

    # ------------------------------------------------------------ reporter thread
    def _resend(self) -> None:
        self._full = True
        self._handles = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(REPORT_INTERVAL_S)
            self._wake.clear()
            if self._stop.is_set() or not ray.is_initialized():
                return
            self.flush()
            self._stop.wait(MIN_GAP_S)

    def _replay(self) -> tuple[list[int], list[int]]:
        """Apply the queued events to the held set; the net (added, removed) ids."""
        with self._lock:
            events, self._pending, self._pending_blocks = self._pending, [], 0
        held = self._held
        before: dict[int, bool] = {}
        for op, hashes in events:
            if op == _CLEARED:
                held.clear()
                before.clear()
                self._full = True
                continue
            for i in engine_ids(hashes).tolist():
                if i not in before:
                    before[i] = i in held
                if op == _STORED:
                    held.add(i)
                else:
                    held.discard(i)
        added = [i for i, was in before.items() if not was and i in held]
        removed = [i for i, was in before.items() if was and i not in held]
        return added, removed

    def _costs(self) -> tuple[float, ...]:
        try:
            return tuple(float(v) for v in self.costs())
        except Exception as e:  # the estimates are advice: a report goes out without them
            logger.debug("kvray: cost estimates unavailable: %s: %s", type(e).__name__, e)
            return ()

    def flush(self) -> bool:
        """Send what changed (or everything, after a refusal); False: not sent."""
        added, removed = self._replay()
        try:
            if self._handles is None:
                self._handles = [
                    ray.get_actor(index_name(self.namespace, i), namespace=RAY_NAMESPACE)
                    for i in range(self.num_index_shards)
                ]
            if self.slot < 0:
                self.slot = ray.get(
                    self._handles[0].engine_register.remote(
                        self.key, self.node_id, self.incarnation
                    ),
                    timeout=CALL_TIMEOUT_S,
                )
                self._full = True
                if self.slot < 0:
                    logger.warning("kvray: no engine-tier slot free; this engine is not routed")
                    return False
            full = self._full
            self._full = False
            info = ReplicaInfo(
                self.slot,
                self.key,
                self.node_id,
                self.incarnation,
                usage=round(float(self._usage()), 2),
                blocks=len(self._held),
                costs=self._costs(),
            )
            add = np.fromiter(self._held, np.uint64) if full else np.array(added, np.uint64)
            rm = np.array([] if full else removed, np.uint64)
            a_sh, r_sh = (
                index_shard_of(add, self.num_index_shards),
                index_shard_of(rm, self.num_index_shards),
            )
            refs = [
                h.engine_update.remote(info, add[a_sh == s], rm[r_sh == s], full)
                for s, h in enumerate(self._handles)
            ]
            placed = ray.get(refs, timeout=CALL_TIMEOUT_S)
        except Exception as e:
            self.failures += 1
            logger.debug("kvray: engine-tier report failed: %s: %s", type(e).__name__, e)
            self._resend()
            return False
        self.reports += 1
        if not all(placed):  # a shard does not know this slot (restarted, or it expired)
            self.slot = -1
            self._full = True
            return False
        return True

    # ------------------------------------------------------------ stop
    def close(self) -> None:
        """Stop reporting and drop this engine's entries from the index now."""
        self._stop.set()
        self._wake.set()
        self._thread.stop(timeout=CALL_TIMEOUT_S + 1)
        handles, slot = self._handles, self.slot
        if handles is None or slot < 0 or not ray.is_initialized():
            return
        try:
            ray.get(
                [h.engine_drop.remote(slot, self.incarnation) for h in handles],
                timeout=CALL_TIMEOUT_S,
            )
        except Exception as e:  # they expire anyway
            logger.debug("kvray: dropping the engine tier's entries failed: %s", e)
