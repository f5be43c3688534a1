"""Errors kvray raises to its callers."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "BlockLostError",
    "InvalidArgumentError",
    "KVRayError",
    "NotStartedError",
    "StoreUnavailableError",
]


class KVRayError(RuntimeError):
    """Base class of kvray's runtime errors.

    Every kvray error pickles with its fields (a subclass whose ``__init__`` takes more than a
    message overrides ``__reduce__``), so it crosses ``ray.get`` as itself.
    """


class BlockLostError(KVRayError):
    """Some requested blocks cannot be served: evicted, their node died, or corrupt.

    ``keys`` names every missing key, so a caller (the connector) can recompute exactly those.
    """

    def __init__(self, keys: Sequence[bytes], reason: str) -> None:
        self.keys = list(keys)
        self.reason = reason
        # Keys of one engine share a long prefix: show their ends.
        shown = ", ".join("..." + k.hex()[-16:] for k in self.keys[:4])
        more = f" and {len(self.keys) - 4} more" if len(self.keys) > 4 else ""
        super().__init__(f"{len(self.keys)} kvray block(s) lost ({reason}): {shown}{more}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.keys, self.reason), self.__dict__)


class NotStartedError(KVRayError):
    """kvray is not running in the requested namespace on this cluster."""


class StoreUnavailableError(KVRayError):
    """A kvray actor did not answer in time or the cluster cannot be reached."""


class InvalidArgumentError(KVRayError, ValueError, TypeError):
    """A caller passed a bad argument to a kvray API; the message names it and the problem.

    Also a ``ValueError`` and a ``TypeError``, so code written against either keeps working.
    """
