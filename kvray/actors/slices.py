"""Reads from another node move only what they load (issue 21).

A pool's segment is one Ray object of up to ``segment_bytes`` of blocks. A reader on the pool's
node maps it zero-copy, whatever part it reads. A reader on another node would pull the whole
object across the network and pin it in its own object store: one 2 MiB block of a 32 MiB
segment would move 32 MiB. So for a remote reader (``lease(..., remote=True)``) the pool puts
the blocks asked for into a fresh object of their own, owned by the pool, and names that object
in the reply in place of the segment, with the positions remapped; the reader cannot tell the
difference. The copy is of the asked bytes only, on the pool's node (its own segment is mapped
zero-copy), outside the pool's lock.

A remote reader asking for more than :data:`WHOLE_ABOVE` of a segment's bytes gets the segment
itself: the copy would save less than a fifth of the transfer. So a remote read moves at most
1.25 times what it loads, plus Ray's framing.

The fresh object lives while the reader holds its ref (Ray's reference counting: the reader is
a borrower of the pool's object), so the segment itself needs no lease once cut: the pool gives
those leases back at once. The checksums in the reply are the stored ones; the reader still
verifies what it received against them.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import ray

from kvray.actors.heap import value
from kvray.meta.messages import LeaseReply

__all__ = ["WHOLE_ABOVE", "cut", "inline", "take"]

#: A remote reader asking for more than this fraction of a segment's bytes gets it whole.
WHOLE_ABOVE = 0.8


def take(payload: Any, positions: list[int]) -> Any:
    """Blocks ``positions`` (ascending) of a segment's payload: a view of the rows when they
    are consecutive rows of a 2D array (``ray.put`` copies just those), else a copy of the rows
    or a list of the blocks."""
    if isinstance(payload, np.ndarray):
        a, b = positions[0], positions[-1] + 1
        return payload[a:b] if b - a == len(positions) else payload[positions]
    return [payload[p] for p in positions]


def _asked(reply: LeaseReply) -> dict[int, list[int]]:
    """Key indexes of ``reply`` by the pool segment (id > 0) that serves them."""
    asked: dict[int, list[int]] = {}
    seg_ids = reply.seg_ids
    for i in np.flatnonzero(seg_ids > 0).tolist():
        asked.setdefault(int(seg_ids[i]), []).append(i)
    return asked


def _blocks_of(reply: LeaseReply, seg_id: int, idx: list[int], deadline: float) -> Any:
    """The blocks keys ``idx`` ask of segment ``seg_id``, positions remapped to 0..n-1 in the
    reply; None (the keys read as missing, with the reason) when the segment's object is lost."""
    order = np.argsort(reply.positions[idx], kind="stable")
    positions = reply.positions[idx][order].tolist()
    try:
        payload = value(reply.segments[seg_id], max(0.0, deadline - time.monotonic()))
        blocks = take(payload, positions)
    except Exception as e:  # the pool's own object is gone: nothing to serve from it
        for i in idx:
            reply.seg_ids[i] = 0
            reply.reasons[i] = f"object lost ({type(e).__name__})"
        del reply.segments[seg_id]
        return None
    reply.positions[np.asarray(idx)[order]] = np.arange(len(idx))
    return blocks


def cut(reply: LeaseReply, whole: dict[int, int], deadline: float) -> tuple[list[int], int]:
    """Replace in ``reply`` each segment (id > 0; ``whole``: its object's bytes) of which at
    most :data:`WHOLE_ABOVE` of the bytes are asked for by a fresh object of the asked blocks.

    Returns the ids of the segments no longer named in ``reply`` (their leases can go) and the
    bytes copied. A segment whose object cannot be read (lost) is not served: its keys read
    as missing, with the reason."""
    gone: list[int] = []
    copied = 0
    for seg_id, idx in _asked(reply).items():
        nbytes = int(reply.nbytes[idx].sum())
        if nbytes > WHOLE_ABOVE * whole.get(seg_id, 0):
            continue
        blocks = _blocks_of(reply, seg_id, idx, deadline)
        gone.append(seg_id)
        if blocks is None:
            continue
        reply.segments[seg_id] = ray.put(blocks)
        copied += nbytes
    return gone, copied


def inline(reply: LeaseReply, limit: int, deadline: float) -> tuple[list[int], int]:
    """When the blocks ``reply`` serves from RAM segments add up to at most ``limit`` bytes,
    move them into the reply itself (``reply.inline``; see
    :data:`~kvray.meta.messages.INLINE_BYTES`): the reader gets them in the call's answer,
    with no object to fetch and no lease to give back. Returns what :func:`cut` does; nothing
    changes (``[], 0``) above ``limit``."""
    asked = _asked(reply)
    total = sum(int(reply.nbytes[idx].sum()) for idx in asked.values())
    if not asked or total > limit:
        return [], 0
    copied = 0
    for seg_id, idx in asked.items():
        blocks = _blocks_of(reply, seg_id, idx, deadline)
        if blocks is None:
            continue
        del reply.segments[seg_id]
        # A copy: the reply must not point into a segment the pool may evict meanwhile.
        if isinstance(blocks, np.ndarray):
            reply.inline[seg_id] = np.array(blocks)
        else:
            reply.inline[seg_id] = [np.array(b) for b in blocks]
        copied += int(reply.nbytes[idx].sum())
    return list(asked), copied
