"""Blocks as callers hand them to the store and as reads give them back (Ray-free).

Validation of keys and blocks (errors that name the problem), the block checksum, and the
values a read returns (:class:`Read`, :class:`Fetched`), shared by the client, its data path
and the connector's worker side.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvray.errors import InvalidArgumentError

__all__ = [
    "Blocks",
    "Fetched",
    "Read",
    "as_blocks",
    "as_bytes_view",
    "check_keys",
    "check_timeout",
    "checksum",
    "checksums",
    "quick_keys",
    "stacked",
]

#: A segment's payload: equal-size blocks as one 2D uint8 array, or a list of 1D uint8 arrays.
Blocks = np.ndarray | list[np.ndarray]


def checksum(block: np.ndarray) -> int:
    """xxh3-64 of a block's bytes: ~25 GB/s, cheap next to moving the bytes."""
    return xxhash.xxh3_64_intdigest(memoryview(block).cast("B"))


def checksums(blocks: Blocks) -> np.ndarray:
    """Checksums of every block (rows of a 2D array, or items of a list)."""
    f = xxhash.xxh3_64_intdigest
    if isinstance(blocks, np.ndarray):
        flat = memoryview(blocks.reshape(-1))
        nb = blocks.shape[1]
        it: Iterable[int] = (f(flat[i * nb : (i + 1) * nb]) for i in range(blocks.shape[0]))
    else:
        it = (f(memoryview(b).cast("B")) for b in blocks)
    return np.fromiter(it, dtype=np.uint64, count=len(blocks))


@dataclass(frozen=True, slots=True)
class Read:
    """One block mapped from a pool's segment, with the checksum it was stored with."""

    array: np.ndarray
    checksum: int
    slot: int


@dataclass(frozen=True)
class Fetched:
    """What :meth:`kvray.Store.fetch` read: the blocks of ``keys`` (a prefix of the request),
    in order; ``reason`` says why the request's next key could not be read (``""``: all read).

    The arrays are zero-copy views of the pools' objects: they pin their segment in the
    object store until dropped, so copy what you need and let them go."""

    keys: list[bytes]
    reason: str
    reads: list[Read] = field(repr=False)
    shard: int = 0
    pools: dict[int, str] = field(default_factory=dict, repr=False)

    @property
    def arrays(self) -> list[np.ndarray]:
        """The blocks' bytes (read-only uint8 arrays), one per key."""
        return [r.array for r in self.reads]


def check_keys(keys: object, what: str = "keys") -> list[bytes]:
    """A list of unique, non-empty ``bytes`` keys, or :class:`InvalidArgumentError`."""
    if keys is None or isinstance(keys, bytes | str) or not isinstance(keys, Sequence):
        raise InvalidArgumentError(
            f"kvray: {what} must be a sequence of bytes keys, got {type(keys).__name__}"
        )
    out = list(keys)
    for i, k in enumerate(out):
        if not isinstance(k, bytes) or not k:
            raise InvalidArgumentError(
                f"kvray: {what}[{i}] must be non-empty bytes, got {type(k).__name__}: {k!r:.40}"
            )
    if len(set(out)) != len(out):
        raise InvalidArgumentError(f"kvray: {what} must be unique within one call")
    return out


def quick_keys(keys: list[Any]) -> list[bytes]:
    """The lookup hot path: a list whose items are all bytes passes without a copy."""
    for i, k in enumerate(keys):
        if type(k) is not bytes or not k:
            raise InvalidArgumentError(
                f"kvray: keys[{i}] must be non-empty bytes, got {type(k).__name__}: {k!r:.40}"
            )
    return keys


def check_timeout(timeout: float | None, default: float) -> float:
    """A timeout argument in seconds (``None``: ``default``), or :class:`InvalidArgumentError`."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 3600:
        raise InvalidArgumentError(f"kvray: timeout must be seconds in (0, 3600], got {timeout!r}")
    return float(timeout)


def as_bytes_view(block: Any, where: str = "block") -> np.ndarray:
    """A flat uint8 view of a numpy array or CPU torch tensor (no copy when contiguous)."""
    if isinstance(block, np.ndarray):
        arr = block
    elif hasattr(block, "numpy") and hasattr(block, "device"):
        if block.device.type != "cpu":
            raise InvalidArgumentError(
                f"kvray: {where} must be a CPU array, got a tensor on {block.device}"
            )
        if block.layout is not _torch_strided():
            raise InvalidArgumentError(
                f"kvray: {where} is a {block.layout} tensor; pass a dense one"
            )
        t = block.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        import torch

        arr = t.reshape(-1).view(torch.uint8).numpy()
    else:
        raise InvalidArgumentError(
            f"kvray: {where} must be a numpy array or a torch tensor, not {type(block).__name__}"
        )
    if arr.dtype.hasobject:
        raise InvalidArgumentError(f"kvray: {where} has dtype {arr.dtype}: blocks are raw bytes")
    if arr.nbytes == 0:
        raise InvalidArgumentError(f"kvray: {where} is empty: a block has at least one byte")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr.reshape(-1).view(np.uint8)


def _torch_strided() -> Any:
    import torch

    return torch.strided


def as_blocks(blocks: Any, n: int) -> np.ndarray | list[np.ndarray]:
    """``n`` blocks as one 2D uint8 array (a 2D array or tensor: row i is block i; no copy when
    contiguous) or a list of flat uint8 arrays; :class:`InvalidArgumentError` otherwise."""
    if blocks is None or isinstance(blocks, bytes | str):
        raise InvalidArgumentError(
            f"kvray: blocks must be a sequence of arrays, got {type(blocks).__name__}"
        )
    is_array = isinstance(blocks, np.ndarray) or (
        hasattr(blocks, "device") and hasattr(blocks, "numpy")
    )
    if is_array and blocks.ndim == 2:
        flat = as_bytes_view(blocks, "blocks")
        rows = flat.reshape(blocks.shape[0], -1)
        if rows.shape[0] != n:
            raise InvalidArgumentError(f"kvray: {n} keys but {rows.shape[0]} blocks")
        return rows
    if not hasattr(blocks, "__len__"):
        raise InvalidArgumentError(
            f"kvray: blocks must be a sequence of arrays, got {type(blocks).__name__}"
        )
    if len(blocks) != n:
        raise InvalidArgumentError(f"kvray: {n} keys but {len(blocks)} blocks")
    return [as_bytes_view(b, f"blocks[{i}]") for i, b in enumerate(blocks)]


#: Largest block a list of equal numpy blocks may have to be stacked into rows by ``put``.
STACK_MAX_BYTES = 64 << 10


def stacked(blocks: Any) -> Any:
    """A list of numpy blocks of one shape and dtype, each at most :data:`STACK_MAX_BYTES`, as
    one array whose rows are the blocks (one copy of their bytes); anything else as it is.

    A segment of rows is one buffer to Ray (client, pool and reader), a list one per block:
    a list of 64-byte arrays went ~5x slower than rows of the same bytes (issue 21)."""
    if not isinstance(blocks, list | tuple) or len(blocks) < 2:
        return blocks
    first = blocks[0]
    if type(first) is not np.ndarray or first.dtype.hasobject:
        return blocks
    if not 0 < first.nbytes <= STACK_MAX_BYTES:
        return blocks
    shape, dtype = first.shape, first.dtype
    for b in blocks:
        if type(b) is not np.ndarray or b.shape != shape or b.dtype != dtype:
            return blocks
    return np.stack(blocks).reshape(len(blocks), -1)
