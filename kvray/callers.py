"""The object whose method is running further up the call stack, for integrations that a host
framework builds from a copy of its own configuration.

vLLM's ``MultiConnector`` builds each child connector from a per-child copy of the engine's
config, and Ray Serve LLM's ``MultiConnectorBackend`` sets each child backend up on a deep copy
of the deployment's config: neither copy leads back to the original, which the wrapper (the
caller) holds. :func:`outermost_caller` finds that wrapper. Ray-free, vLLM-free.
"""

from __future__ import annotations

import sys
from typing import TypeVar

__all__ = ["MAX_FRAMES", "outermost_caller"]

_T = TypeVar("_T")

#: How many frames up a caller is looked for: a wrapper builds its children one frame up;
#: factories, nested wrappers and subclasses calling ``super()`` add a few frames each.
MAX_FRAMES = 32


def outermost_caller(of: object, cls: type[_T], method: str) -> _T | None:
    """The outermost ``cls`` instance other than ``of`` running ``method`` (as the ``self`` of
    that frame) among the :data:`MAX_FRAMES` frames above the caller of this function; None if
    there is none (``of`` was not built by such a wrapper)."""
    found: _T | None = None
    frame = sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        if frame.f_code.co_name == method:
            owner = frame.f_locals.get("self")
            if owner is not of and isinstance(owner, cls):
                found = owner
        frame = frame.f_back
    return found
