"""Completion handles of asynchronous gathers and scatters.

On a GPU a transfer runs on a side stream; the connector must know when it is done (a gather
still reads blocks the next forward may overwrite; a staging buffer cannot be reused while a
transfer reads or writes it). A handle wraps a CUDA event plus everything the transfer uses, so
those tensors stay alive until the event has fired. On the CPU transfers are synchronous and the
handle is complete from the start, so callers need no device-specific code.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable

import torch

logger = logging.getLogger(__name__)

__all__ = ["CompletedHandle", "CudaEventHandle", "TransferHandle"]


@runtime_checkable
class TransferHandle(Protocol):
    """What ``gather_async`` / ``scatter_async`` return."""

    def wait(self) -> None:
        """Block the calling thread until the transfer is complete."""
        ...

    def query(self) -> bool:
        """True when the transfer is complete (never blocks)."""
        ...

    def wait_stream(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait for the transfer on the
        device, without blocking the host. A no-op for CPU transfers."""
        ...


class CompletedHandle:
    """A transfer that already finished (CPU transfers run synchronously)."""

    __slots__ = ()

    def wait(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait_stream(self, stream: Any = None) -> None:
        return None

    def __repr__(self) -> str:
        return "CompletedHandle()"


class CudaEventHandle:
    """A transfer enqueued on a CUDA stream; done when ``event`` has fired.

    ``keepalive`` holds the tensors the transfer reads or writes (index tensors, temporaries)
    until completion is observed, so the caching allocators cannot recycle them early.
    """

    __slots__ = ("_done", "_keepalive", "device", "event")

    def __init__(self, event: torch.cuda.Event, device: torch.device, keepalive: tuple[Any, ...]):
        self.event = event
        self.device = device
        self._keepalive: tuple[Any, ...] | None = keepalive
        self._done = False

    def wait(self) -> None:
        if not self._done:
            self.event.synchronize()
            self._finish()

    def query(self) -> bool:
        if not self._done and self.event.query():
            self._finish()
        return self._done

    def wait_stream(self, stream: Any = None) -> None:
        target = stream if stream is not None else torch.cuda.current_stream(self.device)
        target.wait_event(self.event)

    def _finish(self) -> None:
        self._done = True
        self._keepalive = None

    def __repr__(self) -> str:
        return f"CudaEventHandle(device={self.device}, done={self._done})"
