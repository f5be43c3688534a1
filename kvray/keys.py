"""Block keys: a namespace prefix derived from the KV layout, followed by vLLM's block hash.

The most common bug in KV cache services is serving blocks to a reader whose layout differs
(another model, dtype, block size, hash algorithm, memory layout or TP shard). Every key therefore
starts with a short digest of a :class:`LayoutFingerprint`; two fingerprints that differ in any
field can never produce the same key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass

__all__ = [
    "MAX_GROUPING",
    "PREFIX_BYTES",
    "LayoutFingerprint",
    "block_hash_bytes",
    "grouped_prefix",
    "make_keys",
]

#: Length of the namespace prefix of every key.
PREFIX_BYTES = 12
#: Most shards a block is stored in (one byte of the connector's key prefix; the index keeps a
#: shard mask of 64 bits).
MAX_GROUPING = 64


@dataclass(frozen=True)
class LayoutFingerprint:
    """Everything that must match for a stored block to be valid for a reader.

    ``tp_size`` is the TP size of the engines whose blocks are interchangeable: ``1`` when a
    stored shard's bytes do not depend on who computed it. The connector builds it so for MLA
    (every rank holds the same latent KV: one shard serves all ranks) and for layouts whose
    heads are contiguous per layer (CPU caches: shards are canonical head ranges, see
    :mod:`kvray.kernels.heads`, and the key carries the grouping, :func:`grouped_prefix`);
    other layouts keep their TP size, so engines of different TP sizes never share them.
    """

    model: str
    kv_dtype: str
    block_size: int
    hash_algo: str
    layout: str
    tp_size: int = 1
    tp_rank: int = 0
    #: Anything else that changes the bytes (weights revision, LoRA, kvray format version).
    salt: str = ""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("LayoutFingerprint.model must not be empty")
        if self.block_size <= 0:
            raise ValueError(f"LayoutFingerprint.block_size must be > 0, got {self.block_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"LayoutFingerprint: tp_rank={self.tp_rank} is outside tp_size={self.tp_size}"
            )

    @property
    def prefix(self) -> bytes:
        """The key prefix: a digest of every field, stable across processes and hosts."""
        canonical = json.dumps({"v": 1, **asdict(self)}, sort_keys=True).encode()
        return hashlib.blake2b(canonical, digest_size=PREFIX_BYTES).digest()

    def for_rank(self, tp_rank: int) -> LayoutFingerprint:
        """The same layout as seen by another TP rank."""
        return LayoutFingerprint(**{**asdict(self), "tp_rank": tp_rank})

    def keys(self, block_hashes: Iterable[object]) -> list[bytes]:
        return make_keys(self.prefix, block_hashes)


def grouped_prefix(prefix: bytes, grouping: int) -> bytes:
    """The prefix of the keys of blocks stored in ``grouping`` shards (head ranges): blocks of
    one layout stored by engines of different TP sizes are distinct index entries, each with
    one consistent shard count."""
    if isinstance(grouping, bool) or not isinstance(grouping, int):
        raise TypeError(f"grouping must be an int, got {type(grouping).__name__}")
    if not 1 <= grouping <= MAX_GROUPING:
        raise ValueError(f"grouping must be in 1..{MAX_GROUPING}, got {grouping}")
    return prefix + bytes((grouping,))


def block_hash_bytes(block_hash: object) -> bytes:
    """vLLM block hashes are ``bytes`` (sha256 family) or, for older algorithms, ints."""
    if isinstance(block_hash, bytes | bytearray | memoryview):
        return bytes(block_hash)
    if isinstance(block_hash, int):
        return block_hash.to_bytes(16, "little", signed=True)
    raise TypeError(f"unsupported block hash type {type(block_hash).__name__}")


def make_keys(prefix: bytes, block_hashes: Iterable[object]) -> list[bytes]:
    """Keys for a chain of vLLM block hashes under one namespace prefix."""
    return [prefix + block_hash_bytes(h) for h in block_hashes]
