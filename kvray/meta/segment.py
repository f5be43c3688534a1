"""Per-segment block metadata of a pool: numpy arrays and one key blob, no per-block objects.

A segment is the pool's unit of storage and eviction (up to ``segment_bytes`` of blocks in one
Ray object). Its payload is a 2D uint8 array ``[n, block_nbytes]`` (equal sizes, the common
case) or a list of n 1D uint8 arrays; ``payload[i]`` is block ``i`` either way.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["SegmentMeta", "pack_keys", "payload_bytes"]

#: The arrays of :meth:`SegmentMeta.to_wire`, in order, little-endian.
_WIRE = ("<i8", "<u8", "<u2", "<u2", "<i8", "<u8")


def payload_bytes(blocks: Any) -> bytes:
    """Blocks (a 2D uint8 array or a list of flat uint8 arrays) as one bytes value: what a
    small put sends (Ray passes ``bytes`` for less than an array, see :mod:`kvray.meta.wire`)."""
    if isinstance(blocks, np.ndarray):
        return blocks.tobytes()
    return b"".join(memoryview(np.ascontiguousarray(b)).cast("B") for b in blocks)


def pack_keys(keys: Sequence[bytes]) -> tuple[bytes, np.ndarray]:
    """(concatenated keys, int64 offsets [n+1])."""
    offsets = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, keys), dtype=np.int64, count=len(keys)), out=offsets[1:])
    return b"".join(keys), offsets


@dataclass
class SegmentMeta:
    """What a pool knows of each block of one segment (about 80 bytes a block)."""

    key_blob: bytes  # the full block keys, concatenated
    key_offsets: np.ndarray  # int64 [n+1]: key i is key_blob[key_offsets[i]:key_offsets[i+1]]
    ids: np.ndarray  # uint64 [n]: ids of the keys (kvray.meta.ids.key_ids)
    shards: np.ndarray  # uint16 [n]: shard number of each block (TP rank etc.)
    nshards: np.ndarray  # uint16 [n]: how many shards the block has
    sizes: np.ndarray  # int64 [n]: bytes of each block
    checksums: np.ndarray  # uint64 [n]: xxh3-64 of each block's bytes

    def __post_init__(self) -> None:
        n = int(self.ids.size)
        self.key_offsets = np.asarray(self.key_offsets, dtype=np.int64)
        self.ids = np.asarray(self.ids, dtype=np.uint64)
        self.shards = np.asarray(self.shards, dtype=np.uint16)
        self.nshards = np.asarray(self.nshards, dtype=np.uint16)
        self.sizes = np.asarray(self.sizes, dtype=np.int64)
        self.checksums = np.asarray(self.checksums, dtype=np.uint64)
        if not (
            self.key_offsets.size == n + 1
            and self.shards.size == self.nshards.size == self.sizes.size == n
            and self.checksums.size == n
        ):
            raise ValueError("SegmentMeta: arrays differ in length")
        if n and (
            self.key_offsets[0] != 0
            or self.key_offsets[-1] != len(self.key_blob)
            or (np.diff(self.key_offsets) <= 0).any()
        ):
            raise ValueError("SegmentMeta: key offsets do not cover the key blob")
        if n and ((self.sizes < 0).any() or (self.shards >= self.nshards).any()):
            raise ValueError("SegmentMeta: negative size or shard outside nshards")

    @classmethod
    def from_keys(
        cls,
        keys: Sequence[bytes],
        ids: np.ndarray,
        shards: np.ndarray,
        nshards: np.ndarray,
        sizes: np.ndarray,
        checksums: np.ndarray,
    ) -> SegmentMeta:
        blob, offsets = pack_keys(keys)
        return cls(blob, offsets, ids, shards, nshards, sizes, checksums)

    def __len__(self) -> int:
        return int(self.ids.size)

    def key(self, i: int) -> bytes:
        off = self.key_offsets
        return self.key_blob[off[i] : off[i + 1]]

    def keys(self) -> list[bytes]:
        off = self.key_offsets.tolist()
        blob = self.key_blob
        return [blob[a:b] for a, b in itertools.pairwise(off)]

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())

    def rows_of(self, data: bytes) -> Any:
        """A payload sent as one bytes value (the blocks concatenated, see
        :func:`payload_bytes`): a 2D array of equal blocks, else a list; ValueError when its
        size is not the blocks' (read-only views of ``data``)."""
        flat = np.frombuffer(data, dtype=np.uint8)
        if flat.size != self.nbytes:
            raise ValueError("put_segment: payload size does not match the block sizes")
        n = len(self)
        if n and (self.sizes == self.sizes[0]).all():
            return flat.reshape(n, int(self.sizes[0]))
        return np.split(flat, np.cumsum(self.sizes)[:-1].tolist()) if n else []

    def to_wire(self) -> bytes:
        """All of it as one bytes value: a put sends its pool one small argument, not seven
        arrays Ray would serialize one by one (~0.2 ms a call, measured)."""
        head = np.array([len(self)], dtype="<u8").tobytes()
        parts = [
            a.astype(t, copy=False).tobytes() for a, t in zip(self._arrays(), _WIRE, strict=True)
        ]
        return b"".join((head, *parts, self.key_blob))

    @classmethod
    def from_wire(cls, data: bytes) -> SegmentMeta:
        """The inverse of :meth:`to_wire` (ValueError on data it did not write)."""
        buf = memoryview(data)
        if len(buf) < 8:
            raise ValueError("SegmentMeta: truncated wire data")
        n = int(np.frombuffer(buf, dtype="<u8", count=1)[0])
        counts = (n + 1, n, n, n, n, n)
        if n > len(buf) or 8 + sum(
            k * np.dtype(t).itemsize for k, t in zip(counts, _WIRE, strict=True)
        ) > len(buf):
            raise ValueError("SegmentMeta: truncated wire data")
        arrays, off = [], 8
        for k, t in zip(counts, _WIRE, strict=True):
            arrays.append(np.frombuffer(buf, dtype=t, count=k, offset=off).copy())
            off += k * np.dtype(t).itemsize
        return cls(bytes(buf[off:]), *arrays)

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (self.key_offsets, self.ids, self.shards, self.nshards, self.sizes, self.checksums)

    @property
    def meta_nbytes(self) -> int:
        """Bytes of this metadata (for the pool's bytes-per-block figure)."""
        return (
            len(self.key_blob)
            + sum(
                a.nbytes
                for a in (self.key_offsets, self.ids, self.shards, self.nshards, self.sizes)
            )
            + self.checksums.nbytes
        )

    def select(self, payload: Any, chosen: np.ndarray) -> Any:
        """Blocks ``chosen`` of a client's ``payload`` (a 2D array or a list of arrays), checked
        against the declared sizes (ValueError if they do not match)."""
        if isinstance(payload, np.ndarray) and payload.ndim == 2:
            if payload.shape[0] != len(self) or (self.sizes != payload.shape[1]).any():
                raise ValueError("put_segment: payload shape does not match the block sizes")
            return payload if chosen.size == len(self) else payload[chosen]
        if len(payload) != len(self):
            raise ValueError("put_segment: payload has the wrong number of blocks")
        own = [payload[i] for i in chosen.tolist()]
        got = np.fromiter((a.nbytes for a in own), dtype=np.int64, count=len(own))
        if (got != self.sizes[chosen]).any():
            raise ValueError("put_segment: a block's size does not match its declared size")
        return own

    def take(self, idx: np.ndarray | Sequence[int]) -> SegmentMeta:
        """The metadata of blocks ``idx`` only (in that order)."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == len(self) and (idx == np.arange(idx.size)).all():
            return self
        keys = self.keys()
        return SegmentMeta.from_keys(
            [keys[i] for i in idx.tolist()],
            self.ids[idx],
            self.shards[idx],
            self.nshards[idx],
            self.sizes[idx],
            self.checksums[idx],
        )
