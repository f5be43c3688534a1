"""Segments: the unit a pool stores, evicts and spills (up to ``segment_bytes`` of blocks).

:class:`SegmentMeta` describes the blocks of one segment as a handful of numpy arrays and one
bytes blob of keys, with no per-block Python object: a 32 MiB segment of 2 MiB blocks is 16
blocks, but one of 16 KiB blocks is 2048, and a pool holds thousands of segments.

A segment's *payload* is its bytes in one of two forms, ``payload[i]`` being block ``i`` either
way: a 2D C-contiguous uint8 array ``[n, block_nbytes]`` (every block the same size, the common
case) or a list of ``n`` 1D uint8 arrays (variable sizes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

__all__ = [
    "Payload",
    "SegmentMeta",
    "admit",
    "block_checksum",
    "check_payload",
    "payload_nbytes",
]

Payload = np.ndarray | list[np.ndarray]
"""Block bytes of one segment: ``[n, block_nbytes]`` uint8, or a list of 1D uint8 arrays."""


def block_checksum(block: np.ndarray) -> int:
    """xxh3-64 of a block's bytes: the same value as :func:`kvray.client.checksum`."""
    return xxhash.xxh3_64_intdigest(memoryview(block).cast("B"))


def _array(name: str, value: object, dtype: type, ndim: int = 1) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise TypeError(f"SegmentMeta.{name} must be a numpy array, got {type(value).__name__}")
    if value.dtype != dtype:
        raise TypeError(f"SegmentMeta.{name} must be {np.dtype(dtype)}, got {value.dtype}")
    if value.ndim != ndim:
        raise ValueError(f"SegmentMeta.{name} must be 1D, got shape {value.shape}")
    return value


@dataclass(eq=False)
class SegmentMeta:
    """The blocks of one segment: keys, ids, shards, sizes and checksums, as arrays."""

    #: The full block keys, concatenated.
    key_blob: bytes
    #: int64 ``[n+1]``: key ``i`` is ``key_blob[key_offsets[i]:key_offsets[i+1]]``.
    key_offsets: np.ndarray
    #: uint64 ``[n]``: 64-bit ids of the keys (computed by the caller).
    ids: np.ndarray
    #: uint16 ``[n]``: shard number of each block (TP rank etc.).
    shards: np.ndarray
    #: uint16 ``[n]``: how many shards the block has.
    nshards: np.ndarray
    #: int64 ``[n]``: bytes of each block.
    sizes: np.ndarray
    #: uint64 ``[n]``: xxh3-64 of each block's bytes.
    checksums: np.ndarray

    def __post_init__(self) -> None:
        if not isinstance(self.key_blob, bytes):
            raise TypeError(
                f"SegmentMeta.key_blob must be bytes, got {type(self.key_blob).__name__}"
            )
        offsets = _array("key_offsets", self.key_offsets, np.int64)
        n = len(offsets) - 1
        if n < 0:
            raise ValueError("SegmentMeta.key_offsets must have n+1 >= 1 entries")
        for name, dtype in (
            ("ids", np.uint64),
            ("shards", np.uint16),
            ("nshards", np.uint16),
            ("sizes", np.int64),
            ("checksums", np.uint64),
        ):
            arr = _array(name, getattr(self, name), dtype)
            if len(arr) != n:
                raise ValueError(
                    f"SegmentMeta.{name} has {len(arr)} entries for {n} keys (key_offsets - 1)"
                )
        if offsets[0] != 0 or offsets[-1] != len(self.key_blob):
            raise ValueError(
                f"SegmentMeta.key_offsets must run from 0 to len(key_blob)={len(self.key_blob)},"
                f" got {int(offsets[0])}..{int(offsets[-1])}"
            )
        if n and np.any(np.diff(offsets) <= 0):
            raise ValueError("SegmentMeta.key_offsets must be strictly increasing (empty key)")
        if n and int(self.sizes.min()) < 0:
            raise ValueError("SegmentMeta.sizes must be >= 0")

    @classmethod
    def from_keys(
        cls,
        keys: Sequence[bytes],
        ids: Sequence[int] | np.ndarray,
        shards: Sequence[int] | np.ndarray,
        nshards: Sequence[int] | np.ndarray,
        sizes: Sequence[int] | np.ndarray,
        checksums: Sequence[int] | np.ndarray,
    ) -> SegmentMeta:
        """Build from a list of keys and per-block values (any int sequences)."""
        for i, k in enumerate(keys):
            if not isinstance(k, bytes) or not k:
                raise TypeError(f"SegmentMeta.from_keys: key {i} must be non-empty bytes: {k!r}")
        lengths = np.fromiter((len(k) for k in keys), dtype=np.int64, count=len(keys))
        offsets = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(
            b"".join(keys),
            offsets,
            np.asarray(ids, dtype=np.uint64),
            np.asarray(shards, dtype=np.uint16),
            np.asarray(nshards, dtype=np.uint16),
            np.asarray(sizes, dtype=np.int64),
            np.asarray(checksums, dtype=np.uint64),
        )

    def __len__(self) -> int:
        return len(self.key_offsets) - 1

    def __repr__(self) -> str:
        return f"SegmentMeta({len(self)} blocks, {self.nbytes} bytes)"

    @property
    def nbytes(self) -> int:
        """Bytes of all blocks (sum of ``sizes``)."""
        return int(self.sizes.sum())

    @property
    def meta_nbytes(self) -> int:
        """Bytes of this description itself (keys and arrays)."""
        return len(self.key_blob) + sum(a.nbytes for a in self._arrays())

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (self.key_offsets, self.ids, self.shards, self.nshards, self.sizes, self.checksums)

    def key(self, i: int) -> bytes:
        if not -len(self) <= i < len(self):
            raise IndexError(f"SegmentMeta.key: index {i} out of range for {len(self)} blocks")
        i %= len(self)
        return self.key_blob[int(self.key_offsets[i]) : int(self.key_offsets[i + 1])]

    def all_keys(self) -> list[bytes]:
        """Every key, as a list (allocates one bytes object per block: not for hot paths)."""
        o = self.key_offsets.tolist()
        blob = self.key_blob
        return [blob[o[i] : o[i + 1]] for i in range(len(self))]

    def take(self, idx: Sequence[int] | np.ndarray) -> SegmentMeta:
        """The blocks at positions ``idx`` (in that order), e.g. the ones still live."""
        sel = np.asarray(idx, dtype=np.int64)
        if sel.ndim != 1:
            raise ValueError(f"SegmentMeta.take: idx must be 1D, got shape {sel.shape}")
        n = len(self)
        if len(sel) and (int(sel.min()) < 0 or int(sel.max()) >= n):
            raise IndexError(f"SegmentMeta.take: indices out of range for {n} blocks")
        starts = self.key_offsets[sel]
        lengths = self.key_offsets[sel + 1] - starts
        offsets = np.zeros(len(sel) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        blob = np.frombuffer(self.key_blob, dtype=np.uint8)
        if len(sel):
            # Gather the key bytes without a Python loop: one index array over the blob.
            gather = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
            key_blob = blob[gather].tobytes()
        else:
            key_blob = b""
        return SegmentMeta(
            key_blob,
            offsets,
            self.ids[sel],
            self.shards[sel],
            self.nshards[sel],
            self.sizes[sel],
            self.checksums[sel],
        )

    def digest(self) -> int:
        """xxh3-64 over every field: detects a corrupt description (e.g. read from a file)."""
        h = xxhash.xxh3_64()
        h.update(self.key_blob)
        for a in self._arrays():
            h.update(np.ascontiguousarray(a).data)
        return h.intdigest()


def payload_nbytes(payload: Payload) -> int:
    if isinstance(payload, np.ndarray):
        return int(payload.nbytes)
    return sum(int(a.nbytes) for a in payload)


def check_payload(meta: SegmentMeta, payload: Payload, where: str = "payload") -> None:
    """Raise ``TypeError``/``ValueError`` unless ``payload`` holds ``meta``'s blocks."""
    n = len(meta)
    if isinstance(payload, np.ndarray):
        if payload.dtype != np.uint8 or payload.ndim != 2 or not payload.flags.c_contiguous:
            raise TypeError(
                f"{where}: an array payload must be 2D C-contiguous uint8, got "
                f"{payload.dtype} with shape {payload.shape}"
            )
        if payload.shape[0] != n:
            raise ValueError(f"{where}: {payload.shape[0]} rows for {n} blocks")
        if n and np.any(meta.sizes != payload.shape[1]):
            raise ValueError(f"{where}: block sizes differ from the row size {payload.shape[1]}")
        return
    if not isinstance(payload, list):
        raise TypeError(
            f"{where}: expected a 2D uint8 array or a list of 1D uint8 arrays, got "
            f"{type(payload).__name__}"
        )
    if len(payload) != n:
        raise ValueError(f"{where}: {len(payload)} arrays for {n} blocks")
    sizes = meta.sizes.tolist()
    for i, a in enumerate(payload):
        if (
            not isinstance(a, np.ndarray)
            or a.dtype != np.uint8
            or a.ndim != 1
            or not a.flags.c_contiguous
        ):
            raise TypeError(f"{where}: block {i} must be a 1D C-contiguous uint8 array")
        if a.nbytes != sizes[i]:
            raise ValueError(f"{where}: block {i} has {a.nbytes} bytes, not {sizes[i]}")


def admit(hits: np.ndarray | Sequence[int], min_hits: int) -> np.ndarray | None:
    """Which blocks of a segment to spill under ``disk_admit_min_hits`` (issue 12, item 4).

    ``hits[i]``: how many times block ``i`` was read. Returns None for "every block" (the
    common ``min_hits=0`` case, no array built), else the increasing positions to pass as
    ``DiskTier.spill(..., select=...)`` (empty: nothing to spill).
    """
    if isinstance(min_hits, bool) or not isinstance(min_hits, int) or min_hits < 0:
        raise ValueError(f"admit: min_hits must be an int >= 0, got {min_hits!r}")
    if min_hits == 0:
        return None
    return np.flatnonzero(np.asarray(hits) >= min_hits)
