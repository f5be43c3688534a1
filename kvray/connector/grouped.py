"""The worker side of a hybrid model: one :class:`TransferHandler` per KV cache group.

Each group's layers have their own paged tensors, copy kernels and staging pool, so each group
gets its own handler, and a job goes to the handler of its group (``LoadSpec.group`` /
``StoreSpec.group``). What vLLM sees per *request* is joined over the groups: a request is in
``finished_recving`` (its async load) or ``finished_sending`` (its finish store) once every
group that had such a job for it reported it, and failed if any group's load failed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from kvray.connector.metadata import (
    JobId,
    KVRayConnectorMetadata,
    KVRayWorkerMetadata,
    ReqId,
    TransferCounters,
)
from kvray.connector.transfer import TransferHandler
from kvray.kernels import StagingPool

__all__ = ["GroupedTransfer"]


class _Join:
    """Counts per-request reports of several handlers; a request is done at its expected
    count (a request nobody expected is passed straight through)."""

    def __init__(self) -> None:
        self.expected: Counter[ReqId] = Counter()
        self.got: Counter[ReqId] = Counter()

    def expect(self, req_ids: Iterable[ReqId]) -> None:
        self.expected.update(req_ids)

    def report(self, req_ids: Iterable[ReqId]) -> set[ReqId]:
        done: set[ReqId] = set()
        for r in req_ids:
            self.got[r] += 1
            if self.got[r] >= self.expected.get(r, 1):
                done.add(r)
                self.got.pop(r, None)
                self.expected.pop(r, None)
        return done


class GroupedTransfer:
    """A :class:`~kvray.connector.sides.TransferSide` over one handler per KV cache group."""

    def __init__(self, handlers: Mapping[int, TransferHandler], layers: Mapping[str, int]) -> None:
        self.handlers = dict(handlers)
        #: Layer name -> its group (``wait`` for one layer waits on its group's loads only).
        self.layers = dict(layers)
        self._recv = _Join()
        self._send = _Join()
        self._failed: set[ReqId] = set()

    @property
    def staging(self) -> StagingPool:
        return next(iter(self.handlers.values())).staging

    def submit(self, job_ids: Iterable[JobId], meta: KVRayConnectorMetadata) -> None:
        by_group: dict[int, list[JobId]] = {}
        recv: set[tuple[ReqId, int]] = set()
        send: set[tuple[ReqId, int]] = set()
        for j in job_ids:
            load, store = meta.loads.get(j), meta.stores.get(j)
            if load is None and store is None:
                raise KeyError(f"kvray: job {j} is not in this step's metadata")
            group = load.group if load is not None else store.group  # type: ignore[union-attr]
            if group not in self.handlers:
                raise KeyError(f"kvray: job {j} is for KV cache group {group}, not registered")
            by_group.setdefault(group, []).append(j)
            if load is not None and load.is_async:
                recv.add((load.req_id, group))
            elif store is not None and store.finish:
                send.add((store.req_id, group))
        self._recv.expect(r for r, _ in recv)
        self._send.expect(r for r, _ in send)
        for group, ids in by_group.items():
            self.handlers[group].submit(ids, meta)

    def wait(self, layer_name: str | None = None) -> None:
        group = self.layers.get(layer_name) if layer_name is not None else None
        if group is not None:
            self.handlers[group].wait(layer_name)
            return
        for h in self.handlers.values():
            h.wait()

    def get_finished(self) -> tuple[set[ReqId], set[ReqId], set[ReqId]]:
        sending: set[ReqId] = set()
        recving: set[ReqId] = set()
        for h in self.handlers.values():
            s, r, f = h.get_finished()
            self._failed.update(f)
            sending |= self._send.report(s)
            recving |= self._recv.report(r)
        failed = recving & self._failed
        self._failed -= failed
        return sending, recving, failed

    def load_errors(self) -> set[int]:
        """Always none: block ids are only unique within a group, and vLLM refuses them from a
        connector of several groups. Loads are async there (the connector makes them so) and a
        failed one is reported by request (``get_finished``); the handlers' lists are
        drained."""
        for h in self.handlers.values():
            h.load_errors()
        return set()

    def take_meta(self) -> KVRayWorkerMetadata | None:
        out: KVRayWorkerMetadata | None = None
        for h in self.handlers.values():
            meta = h.take_meta()
            if meta is not None:
                out = meta if out is None else out.aggregate(meta)
        return out

    def counters(self) -> TransferCounters:
        total = TransferCounters()
        for h in self.handlers.values():
            total = total.add(h.counters())
        return total

    def flush(self, timeout: float = 30.0) -> None:
        for h in self.handlers.values():
            h.flush(timeout)

    def shutdown(self) -> None:
        for h in self.handlers.values():
            h.shutdown()
