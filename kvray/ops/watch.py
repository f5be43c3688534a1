"""``kvray status --watch``: a live terminal view of every node's pool, refreshed until Ctrl-C.

Rates (loads/s, stores/s, evictions/s) are the differences of two successive ``stats()``
snapshots over the time between them. Disk-tier figures appear only when the pools report them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import astuple, dataclass
from typing import Any, Protocol

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvray.config import ConfigError, check_number

NodeStats = Mapping[str, Any]


class StatsSource(Protocol):
    """What the view reads: ``kvray.connect(...)`` returns one."""

    def stats(self, timeout: float = ...) -> dict[str, Any]: ...


@dataclass(frozen=True)
class NodeRates:
    """Per-second figures of one pool between two snapshots."""

    loads: float  # blocks read (leased by readers)
    load_bytes: float  # bytes readers reported as served
    stores: float  # blocks stored
    store_bytes: float
    evictions: float

    def __add__(self, other: NodeRates) -> NodeRates:
        return NodeRates(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


class Rates:
    """Per-node rates from successive ``stats()`` snapshots.

    A node seen for the first time, or whose counters went down (its pool restarted), has no
    rate for that interval. Only the nodes of the latest snapshot are remembered.
    """

    _COUNTERS = ("hits", "served_bytes", "stored", "stored_bytes", "evictions")

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, NodeStats]] = {}

    def update(self, nodes: Mapping[str, NodeStats], now: float) -> dict[str, NodeRates | None]:
        out: dict[str, NodeRates | None] = {}
        last, self._last = self._last, {}
        for node_id, s in nodes.items():
            if "error" in s:
                out[node_id] = None
                continue
            self._last[node_id] = (now, s)
            prev = last.get(node_id)
            out[node_id] = _rates(prev[1], s, now - prev[0]) if prev else None
        return out


def _rates(old: NodeStats, new: NodeStats, dt: float) -> NodeRates | None:
    if dt <= 0:
        return None
    d = {k: new.get(k, 0) - old.get(k, 0) for k in Rates._COUNTERS}
    if any(v < 0 for v in d.values()):
        return None
    return NodeRates(
        loads=d["hits"] / dt,
        load_bytes=d["served_bytes"] / dt,
        stores=d["stored"] / dt,
        store_bytes=d["stored_bytes"] / dt,
        evictions=d["evictions"] / dt,
    )


def _hit_rate(hits: float, misses: float) -> str:
    asked = hits + misses
    return f"{100 * hits / asked:.1f}%" if asked else "-"


def _size(n: float) -> str:
    """Compact binary size: ``640K``, ``1.5G``."""
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.1f}{unit}" if 0 < abs(n) < 10 and unit != "B" else f"{n:.0f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _used(s: Mapping[str, float], used: str, capacity: str) -> str:
    cap = s.get(capacity, 0)
    pct = f" {100 * s.get(used, 0) / cap:3.0f}%" if cap else ""
    return f"{_size(s.get(used, 0))}/{_size(cap)}{pct}"


def _rate(per_s: float) -> str:
    return f"{per_s:,.1f}" if per_s < 100 else f"{per_s:,.0f}"


def _has_disk(nodes: Mapping[str, NodeStats]) -> bool:
    return any("disk_bytes" in s or "disk_blocks" in s for s in nodes.values())


_SUMMED = ("blocks", "bytes", "capacity", "hits", "misses", "refused", "lost", "active_leases")
_DISK = ("disk_blocks", "disk_bytes", "disk_capacity")


def _row(name: str, s: Mapping[str, float], r: NodeRates | None, disk: bool) -> list[str]:
    row = [
        name,
        f"{int(s.get('blocks', 0)):,}",
        _used(s, "bytes", "capacity"),
        _hit_rate(s.get("hits", 0), s.get("misses", 0)),
        _rate(r.loads) if r else "-",
        _rate(r.stores) if r else "-",
        _rate(r.evictions) if r else "-",
        f"{int(s.get('refused', 0)):,}",
        f"{int(s.get('lost', 0)):,}",
        f"{int(s.get('active_leases', 0)):,}",
    ]
    if disk:
        row += [f"{int(s.get('disk_blocks', 0)):,}", _used(s, "disk_bytes", "disk_capacity")]
    return row


def render(
    stats: Mapping[str, Any],
    rates: Mapping[str, NodeRates | None],
    *,
    updated: str,
    interval_s: float,
    error: str | None = None,
) -> RenderableType:
    """One snapshot: a row per node (and a total row), the traffic in bytes, the index, the
    time of the snapshot and, under it, any error."""
    nodes: Mapping[str, NodeStats] = stats.get("nodes", {})
    disk = _has_disk(nodes)
    table = Table(
        title=f"kvray namespace {stats.get('namespace', '?')}",
        box=None,
        header_style="bold underline",
        padding=(0, 1),
        pad_edge=False,
    )
    cols = ["node", "blocks", "used / capacity", "hit rate", "loads/s", "stores/s", "evict/s"]
    cols += ["refused", "lost", "leases"]
    if disk:
        cols += ["disk blk", "disk used / cap"]
    for col in cols:
        table.add_column(col, justify="left" if col == "node" else "right")
    tot: dict[str, float] = {}
    moved = NodeRates(0.0, 0.0, 0.0, 0.0, 0.0)
    errors: list[Text] = []
    for node_id, s in sorted(nodes.items()):
        if "error" in s:
            table.add_row(node_id[:12], Text("error", style="bold red"))
            errors.append(Text(f"node {node_id[:12]}: {s['error']}", style="red"))
            continue
        r = rates.get(node_id)
        for k in _SUMMED + _DISK:
            tot[k] = tot.get(k, 0) + s.get(k, 0)
        if r is not None:
            moved = moved + r
        table.add_row(*_row(node_id[:12], s, r, disk))
    any_rate = any(r is not None for r in rates.values())
    if len(nodes) > 1:
        table.add_section()
        table.add_row(*_row("total", tot, moved if any_rate else None, disk), style="bold")
    idx = stats.get("index", {})
    traffic = (
        f"loads {_size(moved.load_bytes)}/s · stores {_size(moved.store_bytes)}/s · "
        if any_rate
        else ""
    )
    parts: list[RenderableType] = [
        table,
        Text(
            f"{traffic}index: {idx.get('keys', 0):,} keys, {idx.get('pools', 0)} live pool(s)\n"
            f"updated {updated} · every {interval_s:g}s · Ctrl-C to quit"
        ),
        *errors,
    ]
    if error:
        parts.append(Text(f"stats failed at {updated}: {error}; retrying", style="red"))
    return Group(*parts)


def watch(
    source: StatsSource,
    console: Console,
    *,
    interval_s: float = 1.0,
    timeout_s: float = 10.0,
    frames: int | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Redraw the view every ``interval_s`` until Ctrl-C (or ``frames`` redraws, for tests).

    A failed ``stats()`` call keeps the last table on screen with the error under it.
    """
    interval_s = check_number(interval_s, "interval_s", low=0.1, high=3600, unit="seconds")
    timeout_s = check_number(timeout_s, "timeout_s", high=3600, low_open=True, unit="seconds")
    if frames is not None and frames < 1:
        raise ConfigError("frames", frames, "must be >= 1")
    rates = Rates()
    last: dict[str, Any] = {"nodes": {}}
    last_rates: dict[str, NodeRates | None] = {}
    shown = 0
    start = clock()
    try:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while frames is None or shown < frames:
                error = None
                try:
                    last = source.stats(timeout=timeout_s)
                    last_rates = rates.update(last["nodes"], clock())
                except Exception as e:  # a monitor keeps going: the next tick may succeed
                    error = f"{type(e).__name__}: {e}"
                updated = time.strftime("%H:%M:%S")
                view = render(last, last_rates, updated=updated, interval_s=interval_s, error=error)
                live.update(view, refresh=True)
                shown += 1
                if frames is not None and shown >= frames:
                    break
                # Ticks on a fixed grid; after a stats() call slower than the interval, a new
                # grid from now (no burst of catch-up calls).
                delay = start + shown * interval_s - clock()
                if delay < 0:
                    start -= delay
                time.sleep(max(0.0, delay))
    except KeyboardInterrupt:
        return
