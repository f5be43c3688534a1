"""The hot calls between a process and its pool as one bytes value each way (issue 35, item 4).

Ray serializes each argument and return value on its own, and a numpy array or a dataclass
holding arrays costs far more than a ``bytes`` of the same data (measured on a 2-core node:
a lease call with its keys as a list and ids as an array 1.42 ms, the same as one bytes value
1.04 ms; a small read's reply as a :class:`~kvray.meta.messages.LeaseReply` 1.75 ms, as bytes
1.05 ms). Worse, a reply of 96 KiB of blocks plus its pickled arrays passes Ray's 100 KiB
inline limit and goes through the object store (2.8 ms): the same reply as bytes stays under it.

So a read's request (:func:`lease_request` / :func:`parse_lease_request`) and a reply served
wholly by value (:func:`reply_to_wire` / :func:`reply_from_wire`) travel as bytes. A reply
that names objects (a large read, blocks from disk) stays a ``LeaseReply``: Ray must see its
``ObjectRef``s to count the reader as their borrower. Little-endian throughout; decoding
data it did not write raises ValueError.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvray.meta.messages import LeaseReply
from kvray.meta.segment import pack_keys

__all__ = ["lease_request", "parse_lease_request", "reply_from_wire", "reply_to_wire"]

_REQUEST = struct.Struct("<IIdBq")  # keys, shard, timeout (s, NaN: none), remote, inline
_REPLY = struct.Struct("<qII")  # lease id, keys, inline segments
_SEGMENT = struct.Struct("<qI")  # inline segment id, its blocks


def lease_request(
    keys: Sequence[bytes],
    ids: np.ndarray,
    shard: int,
    timeout: float | None,
    remote: bool,
    inline: int,
) -> bytes:
    """The arguments of a pool's ``lease`` as one value."""
    blob, offsets = pack_keys(keys)
    head = _REQUEST.pack(
        len(keys), shard, float("nan") if timeout is None else timeout, remote, inline
    )
    return b"".join(
        (head, offsets.astype("<i8").tobytes(), np.asarray(ids, dtype="<u8").tobytes(), blob)
    )


def parse_lease_request(
    data: bytes,
) -> tuple[list[bytes], np.ndarray, int, float | None, bool, int]:
    """(keys, ids, shard, timeout, remote, inline) of :func:`lease_request`."""
    buf = memoryview(data)
    if len(buf) < _REQUEST.size:
        raise ValueError("lease request: truncated")
    n, shard, timeout, remote, inline = _REQUEST.unpack_from(buf)
    at = _REQUEST.size
    if len(buf) < at + 16 * n + 8:
        raise ValueError("lease request: truncated")
    offsets = np.frombuffer(buf, dtype="<i8", count=n + 1, offset=at).tolist()
    at += 8 * (n + 1)
    ids = np.frombuffer(buf, dtype="<u8", count=n, offset=at).astype(np.uint64)
    at += 8 * n
    blob = bytes(buf[at:])
    if (
        offsets[0] != 0
        or offsets[-1] != len(blob)
        or any(b < a for a, b in itertools.pairwise(offsets))
    ):
        raise ValueError("lease request: key offsets do not cover the keys")
    keys = [blob[a:b] for a, b in itertools.pairwise(offsets)]
    return keys, ids, shard, None if timeout != timeout else timeout, bool(remote), inline


def reply_to_wire(reply: LeaseReply) -> bytes | None:
    """A reply served wholly by value as bytes; None when it names objects (send it as is)."""
    if reply.segments:
        return None
    n = int(reply.seg_ids.size)
    parts: list[Any] = [
        _REPLY.pack(reply.lease_id, n, len(reply.inline)),
        reply.seg_ids.astype("<i8").tobytes(),
        reply.positions.astype("<i8").tobytes(),
        reply.nbytes.astype("<i8").tobytes(),
        reply.checksums.astype("<u8").tobytes(),
    ]
    for seg_id, blocks in reply.inline.items():
        rows = [blocks] if isinstance(blocks, np.ndarray) and blocks.ndim == 2 else list(blocks)
        count = len(blocks)
        parts.append(_SEGMENT.pack(seg_id, count))
        parts.extend(memoryview(np.ascontiguousarray(r)).cast("B") for r in rows)
    reasons = "\0".join(f"{i}\0{why}" for i, why in reply.reasons.items()).encode()
    parts.append(reasons)
    return b"".join(parts)


def reply_from_wire(data: bytes) -> LeaseReply:
    """The :class:`LeaseReply` of :func:`reply_to_wire` (its inline blocks are read-only views
    of ``data``: the reader copies or verifies them, as it does any read)."""
    buf = memoryview(data)
    if len(buf) < _REPLY.size:
        raise ValueError("lease reply: truncated")
    lease_id, n, nseg = _REPLY.unpack_from(buf)
    at = _REPLY.size
    if len(buf) < at + 32 * n:
        raise ValueError("lease reply: truncated")
    arrays = []
    for dtype in ("<i8", "<i8", "<i8", "<u8"):
        arrays.append(np.frombuffer(buf, dtype=dtype, count=n, offset=at).copy())
        at += 8 * n
    seg_ids, positions, nbytes, sums = arrays
    reply = LeaseReply(lease_id, seg_ids, positions, nbytes, sums)
    for _ in range(nseg):
        if len(buf) < at + _SEGMENT.size:
            raise ValueError("lease reply: truncated")
        seg_id, count = _SEGMENT.unpack_from(buf, at)
        at += _SEGMENT.size
        mine = np.flatnonzero(seg_ids == seg_id)
        sizes = np.zeros(count, dtype=np.int64)
        pos = positions[mine]
        if mine.size != count or (count and (pos.min() < 0 or pos.max() >= count)):
            raise ValueError("lease reply: inline blocks do not match their keys")
        sizes[pos] = nbytes[mine]
        end = at + int(sizes.sum())
        if len(buf) < end:
            raise ValueError("lease reply: truncated")
        flat = np.frombuffer(buf, dtype=np.uint8, count=end - at, offset=at)
        if count and (sizes == sizes[0]).all():
            reply.inline[seg_id] = flat.reshape(count, int(sizes[0]))
        else:
            cuts = np.cumsum(sizes)[:-1]
            reply.inline[seg_id] = np.split(flat, cuts) if count else []
        at = end
    if at < len(buf):
        fields = bytes(buf[at:]).decode().split("\0")
        if len(fields) % 2:
            raise ValueError("lease reply: malformed reasons")
        reply.reasons = {int(fields[k]): fields[k + 1] for k in range(0, len(fields), 2)}
    return reply
