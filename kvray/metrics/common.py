"""What the metrics sets share: a stand-in where Ray metrics cannot be recorded, counters
exported from 0, latency buckets."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TypeVar

from ray.util import metrics

__all__ = ["LATENCY_BOUNDARIES", "PROMOTE_FAILURE_CAUSES", "Disabled", "declare", "export_zero"]

_M = TypeVar("_M")

logger = logging.getLogger(__name__)
#: ``export_zero`` failures so far (logged once: the next ones say nothing new).
export_zero_failures = 0


def declare(
    kind: Callable[..., _M], specs: Mapping[str, tuple[str, str]], keys: tuple[str, ...]
) -> dict[str, _M]:
    """Ray metrics of one kind (``metrics.Counter``, ``metrics.Gauge``) from a table
    ``{figure: (metric name, description)}``, by figure, all with tag keys ``keys``."""
    return {fig: kind(name, doc, tag_keys=keys) for fig, (name, doc) in specs.items()}


class Disabled:
    """Stands in for a metrics set where Ray metrics cannot be recorded (unit tests)."""

    def __getattr__(self, name: str) -> object:
        return noop


def noop(*args: object, **kwargs: object) -> None:
    return None


#: Why a read of a block held on disk failed (``promote_failed_<cause>`` in a pool's stats).
PROMOTE_FAILURE_CAUSES = ("no_room", "corrupt", "io")


def export_zero(counter: metrics.Counter, tags: dict[str, str]) -> None:
    """Export ``counter`` at 0 for ``tags`` before its first event. ``Counter.inc`` refuses
    0; ``_record`` is what it calls. Best effort: without it the series starts at its first
    event, as Ray's counters do (logged once, counted in ``export_zero_failures``)."""
    global export_zero_failures
    try:
        counter._record(0, tags=tags)
    except Exception as e:  # a private Ray API: the series then starts at its first event
        export_zero_failures += 1
        if export_zero_failures == 1:
            logger.warning(
                "kvray metrics: counters start at their first event, not at 0 "
                "(Ray's Counter._record failed: %s: %s)",
                type(e).__name__,
                e,
            )


LATENCY_BOUNDARIES = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]
