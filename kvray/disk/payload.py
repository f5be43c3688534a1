"""Segment payloads and checks around :class:`~kvray.meta.segment.SegmentMeta` for the disk tier.

A segment's *payload* is its bytes in one of two forms, ``payload[i]`` being block ``i`` either
way: a 2D C-contiguous uint8 array ``[n, block_nbytes]`` (every block the same size, the common
case) or a list of ``n`` 1D uint8 arrays (variable sizes). Also here: a digest of a segment's
metadata (stored in its file) and the spill admission rule. Blocks are checked with the
client's checksum (:func:`kvray.blocks.checksum`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from kvray.blocks import Blocks, checksum
from kvray.meta.segment import SegmentMeta

__all__ = [
    "Payload",
    "admit",
    "bad_blocks",
    "check_payload",
    "check_select",
    "meta_digest",
    "payload_nbytes",
]

Payload = Blocks
"""Block bytes of one segment: ``[n, block_nbytes]`` uint8, or a list of 1D uint8 arrays."""


def meta_digest(meta: SegmentMeta) -> int:
    """xxh3-64 over every field of ``meta``: detects a corrupt description read from a file."""
    h = xxhash.xxh3_64()
    h.update(meta.key_blob)
    for a in (meta.key_offsets, meta.ids, meta.shards, meta.nshards, meta.sizes, meta.checksums):
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


def check_select(meta: SegmentMeta, select: object, where: str) -> np.ndarray:
    """``select`` as int64 positions; ``ValueError`` unless 1D, increasing and < len(meta)."""
    sel = np.asarray(select, dtype=np.int64)
    if sel.ndim != 1:
        raise ValueError(f"{where}: select must be 1D, got shape {sel.shape}")
    if len(sel) and (sel[0] < 0 or sel[-1] >= len(meta) or np.any(np.diff(sel) <= 0)):
        raise ValueError(f"{where}: select must be increasing positions < {len(meta)}")
    return sel


def bad_blocks(meta: SegmentMeta, payload: Payload, select: list[int] | None = None) -> list[int]:
    """Positions (of ``select``, or all) of the blocks whose xxh3 differs from
    ``meta.checksums``."""
    sums = meta.checksums.tolist()
    where = range(len(sums)) if select is None else select
    return [i for i in where if checksum(payload[i]) != sums[i]]


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
