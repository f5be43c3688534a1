"""Ray dashboard metrics of the pools and the index (``ray_kvray_*`` at each node's endpoint).

``ray.util.metrics`` objects are cheap to update but must be created inside the process that
records them, so each actor builds its own set. Tags carry the kvray namespace and node.

Counters are exported from 0 as soon as their owner exists (:func:`export_zero`), not from
their first event: a rate or an alert over a rare event (a lost block, a purge) then reads 0
instead of "no data", and every documented series can be checked at the endpoint
(tests/test_metrics.py).
"""

from __future__ import annotations

from kvray.metrics.common import PROMOTE_FAILURE_CAUSES, export_zero
from kvray.metrics.server import IndexMetrics, PoolMetrics
from kvray.metrics.tally import ClientMetrics, ClientTally, ViewTally

__all__ = [
    "PROMOTE_FAILURE_CAUSES",
    "ClientMetrics",
    "ClientTally",
    "IndexMetrics",
    "PoolMetrics",
    "ViewTally",
    "export_zero",
]
