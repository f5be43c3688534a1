"""One rank's share of a load job: the stored shards holding its heads, fetched and verified
together (one path for a same-TP hit, a head window of one shard and pieces of several).

A block counts for the rank only when every shard it needs was read and matches its checksum:
the job keeps the blocks every shard could read (``readable``), and ``done`` the leading ones
all of whose shards verified. Every shard is verified, so each corrupt one is reported to its
pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvray.blocks import Fetched
from kvray.connector.keyspace import EngineKeySpace
from kvray.connector.metadata import JobId, LoadSpec
from kvray.connector.paged import Source
from kvray.connector.sides import TransferStore
from kvray.kernels.heads import HeadPart
from kvray.meta.ids import key_ids

__all__ = ["LoadJob", "TransferStore"]

#: A pool's reason for a block it does not hold (yet): a handoff looks for it again.
NOT_YET = "evicted or never stored"
#: Pause between a handoff's looks for blocks still being put.
RETRY_S = 0.005


@dataclass
class LoadJob:
    job_id: JobId
    spec: LoadSpec
    keys: list[bytes]
    #: The stored shards holding this rank's heads, and each one's pool slot per block.
    parts: list[HeadPart]
    slots: list[list[int]]
    pools: dict[int, str]
    t0: float = field(default_factory=time.perf_counter)
    t0_mono: float = field(default_factory=time.monotonic)
    #: One per part, all cut to the blocks every part could read.
    fetched: list[Fetched] = field(default_factory=list)
    why: str = ""
    done: int = 0  # leading blocks in place and verified

    @classmethod
    def plan(
        cls,
        key_space: EngineKeySpace,
        parts_by_grouping: dict[int, list[HeadPart]],
        job_id: JobId,
        spec: LoadSpec,
    ) -> LoadJob:
        """This rank's load of ``spec``; a grouping it cannot read loads nothing (an error)."""
        parts = parts_by_grouping.get(spec.grouping or key_space.num_shards)
        if parts is None:
            job = cls(job_id, spec, [], [], [], spec.pools)
            job.why = f"grouping {spec.grouping} is not readable here"
            return job
        return cls(
            job_id,
            spec,
            key_space.block_keys(spec.block_hashes, spec.grouping),
            parts,
            [spec.slots(p.shard) for p in parts],
            spec.pools,
        )

    @property
    def readable(self) -> int:
        return len(self.fetched[0].keys) if self.fetched else 0

    def sources(self) -> list[Source]:
        return [(f.arrays, part) for f, part in zip(self.fetched, self.parts, strict=True)]

    def fetch(self, store: TransferStore, deadline: float) -> None:
        """Fetch every stored shard the rank needs (later shards only the blocks the earlier
        ones could read); keep the blocks all of them could read. A handoff (``wait_s``)
        fetches again while blocks are not in their pool yet (a prefill still putting
        them), until ``wait_s`` after the job started."""
        if not self.parts:
            return
        until = min(deadline, self.t0_mono + self.spec.wait_s)
        while True:
            self._fetch_once(store, deadline)
            if self.readable == len(self.keys) or not self.why.startswith(NOT_YET):
                return
            if time.monotonic() + RETRY_S >= until:
                return
            time.sleep(RETRY_S)

    def _fetch_once(self, store: TransferStore, deadline: float) -> None:
        self.why, self.fetched = "", []
        ids = key_ids(self.keys)
        n = len(self.keys)
        got: list[Fetched] = []
        for part, slots in zip(self.parts, self.slots, strict=True):
            left = deadline - time.monotonic()
            if left <= 0:
                self.why = f"load timed out ({time.monotonic() - self.t0_mono:.2f} s)"
                return
            f = store.fetch_from(self.keys[:n], ids[:n], part.shard, slots[:n], self.pools, left)
            got.append(f)
            if len(f.keys) < n:
                n, self.why = len(f.keys), f.reason
        self.fetched = [
            f if len(f.keys) == n else Fetched(f.keys[:n], f.reason, f.reads[:n], f.shard, f.pools)
            for f in got
        ]

    def verify(self, store: TransferStore, sums: list[list[int | None]] | None) -> None:
        """``done``: the leading blocks all of whose shards match their checksums (``sums``:
        per shard, the checksums the copy already took)."""
        done = [
            store.verify(f, sums[p] if sums is not None else None)
            for p, f in enumerate(self.fetched)
        ]
        self.done = min(done, default=0)
        if self.done < self.readable:
            self.why = "checksum mismatch"
