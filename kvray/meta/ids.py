"""Fixed-width block ids: a 64-bit digest of a block's full key.

``0`` and ``1`` are reserved as the empty and deleted markers of
:class:`~kvray.meta.idtable.IdTable`, so a digest that lands there is moved up by 2 (two of
2**64 values: no measurable bias).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = ["EMPTY", "TOMB", "engine_ids", "index_shard_of", "key_ids", "shard_ids"]

EMPTY = np.uint64(0)
TOMB = np.uint64(1)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _reserve(ids: np.ndarray) -> np.ndarray:
    low = ids < 2
    if low.any():
        ids[low] += np.uint64(2)
    return ids


def key_ids(keys: Sequence[bytes]) -> np.ndarray:
    """The ids of ``keys`` (uint64, never 0 or 1): xxh3-64 of each key, ~80 ns a key."""
    ids = np.fromiter(map(xxhash.xxh3_64_intdigest, keys), dtype=np.uint64, count=len(keys))
    return _reserve(ids)


def engine_ids(hashes: Sequence[bytes | int]) -> np.ndarray:
    """Ids of vLLM block hashes in the engine tier: the hash's low 64 bits, as vLLM's KV events
    give them (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the default); a 32-byte hash gives
    the same id (its last 8 bytes, big-endian). Chained hashes: a prefix's id names its tokens
    and everything before them."""
    if not hashes:
        return np.zeros(0, dtype=np.uint64)
    if isinstance(hashes[0], int):
        ids = np.fromiter(hashes, dtype=np.uint64, count=len(hashes))
    else:
        tails = b"".join(bytes(h)[-8:].rjust(8, b"\0") for h in hashes)  # type: ignore[arg-type]
        ids = np.frombuffer(tails, dtype=">u8").astype(np.uint64)
    return _reserve(ids)


def shard_ids(ids: np.ndarray, shards: np.ndarray | int) -> np.ndarray:
    """Ids of the shards of blocks (a pool's table keys): a splitmix64 mix of id and shard."""
    with np.errstate(over="ignore"):
        z = ids ^ (np.asarray(shards, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z ^= z >> np.uint64(31)
    return _reserve(np.asarray(z, dtype=np.uint64))


def index_shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Which index shard owns each id: a range of the id space per shard (multiply-shift on
    the high 32 bits, so any shard count splits it evenly)."""
    if num_shards == 1:
        return np.zeros(ids.shape, dtype=np.int64)
    return ((ids >> np.uint64(32)) * np.uint64(num_shards) >> np.uint64(32)).astype(np.int64)
