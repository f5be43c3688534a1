"""One validated configuration object for kvray.

The same object is built from ``kv_connector_extra_config`` (vLLM), from CLI flags and from
``kvray.start(...)`` keyword arguments, so a value means the same thing everywhere and a bad one
fails in the same way: one :class:`ConfigError` that names the field and the value.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvray.meta.eviction import POLICIES

__all__ = [
    "MAX_BYTES",
    "MIN_CAPACITY",
    "ConfigError",
    "KVRayConfig",
    "check_namespace",
    "check_number",
    "format_bytes",
    "parse_bytes",
]


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field and the value."""

    def __init__(self, field_name: str, value: object, reason: str) -> None:
        super().__init__(f"kvray config: invalid {field_name}={value!r}: {reason}")
        self.field_name = field_name
        self.value = value
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled with its fields (the default rebuilds from the message alone and fails), so
        # a ConfigError raised in a Ray task reaches ``ray.get``'s caller as itself.
        return (type(self), (self.field_name, self.value, self.reason), self.__dict__)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "ti": 1 << 40,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


#: No size kvray is given can sensibly exceed this (1 PiB); it also keeps every size a
#: 64-bit integer for Ray, numpy and the metrics.
MAX_BYTES = 1 << 50


#: Least capacity of a pool's RAM and of its disk tier.
MIN_CAPACITY = 1 << 20


def parse_bytes(value: int | float | str, field_name: str = "size", *, least: int = 0) -> int:
    """Parse ``4GiB``, ``512MB``, ``1e9`` or an int into bytes (GiB = 2**30, GB = 10**9).

    Infinite, NaN, negative, absurd (over 1 PiB) sizes and sizes under ``least`` raise
    :class:`ConfigError`.
    """
    if isinstance(value, bool):
        raise ConfigError(field_name, value, "expected a size such as 4GiB or a byte count")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        n = int(_finite_size(value, field_name, value))
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None:
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(
                    field_name, value, "expected a size such as 4GiB, 512MB or 1048576"
                ) from None
            n = int(_finite_size(number, field_name, value))
        else:
            unit = m.group(2).lower()
            if unit not in _UNITS:
                raise ConfigError(
                    field_name, value, f"unknown unit {m.group(2)!r} (use B, KiB, MiB, GiB, GB...)"
                )
            n = int(_finite_size(float(m.group(1)) * _UNITS[unit], field_name, value))
    else:
        raise ConfigError(field_name, value, "expected a size such as 4GiB or a byte count")
    if n < 0:
        raise ConfigError(field_name, value, "must not be negative")
    if n > MAX_BYTES:
        raise ConfigError(field_name, value, f"must be at most 1 PiB ({MAX_BYTES} bytes)")
    if n < least:
        raise ConfigError(field_name, value, f"must be at least {_exact_size(least)}")
    return n


def _exact_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it (``64 KiB``, ``1 MiB``)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def _finite_size(number: float, field_name: str, value: object) -> float:
    """``number`` itself; infinity, NaN (``"inf"``, ``"1e400"``) and negative values (also
    those ``int()`` would round to 0) are ConfigErrors."""
    if not math.isfinite(number):
        raise ConfigError(field_name, value, "expected a finite size")
    if number < 0:
        raise ConfigError(field_name, value, "must not be negative")
    return number


def check_number(
    value: object,
    field_name: str,
    *,
    low: float = 0.0,
    high: float = math.inf,
    low_open: bool = False,
    unit: str = "",
) -> float:
    """``value`` as a float when it is a real number (not a bool, not NaN, not infinite) in
    ``[low, high]`` (``(low, high]`` with ``low_open``); otherwise a :class:`ConfigError`
    naming ``field_name`` and the range (``unit``, such as ``seconds``, is said with it)."""
    lo = "(" if low_open else "["
    hi = "]" if math.isfinite(high) else ")"
    span = f"{lo}{low:g}, {high:g}{hi}" + (f" {unit}" if unit else "")
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if not number or not math.isfinite(value):  # type: ignore[arg-type]
        raise ConfigError(field_name, value, f"expected a finite number in {span}")
    v = float(value)  # type: ignore[arg-type]
    if v < low or (low_open and v == low) or v > high:
        raise ConfigError(field_name, value, f"expected a number in {span}")
    return v


def format_bytes(n: float) -> str:
    """Human-readable binary size (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_namespace(value: object, field_name: str = "namespace") -> str:
    """A kvray namespace: 1-64 letters, digits, ``_``, ``-`` or ``.``, not starting with a
    punctuation mark (it names actors, keys' prefixes and a directory of the disk tier)."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ConfigError(field_name, value, "use 1-64 letters, digits, '_', '-' or '.'")
    return value


_LOAD_MODES = ("sync", "layerwise", "async")
#: The size fields and the least each may be (``disk_capacity``: see ``_check_disk``).
_SIZE_FIELDS = {
    "capacity": MIN_CAPACITY,
    "segment_bytes": 4 << 10,
    "max_inflight_put_bytes": 0,
    "staging_bytes": 0,
    "disk_capacity": 0,
    "load_bytes_per_s": 1 << 20,
}
#: Upper bound of ``disk_admit_min_hits`` (a higher value would admit nothing, silently).
MAX_ADMIT_HITS = 1 << 20


@dataclass(frozen=True)
class KVRayConfig:
    """Everything a kvray deployment and its clients can be told.

    Defaults suit a laptop: 1 GiB of CPU memory per node, checksums on, loads synchronous.
    Field names are the keys of ``kv_connector_extra_config`` and the ``--flags`` of the CLI.
    """

    #: Isolates deployments on one cluster: actors are named ``<namespace>/...``.
    namespace: str = "default"
    #: Ray address to join (``auto``, ``HOST:PORT``, ``ray://...``). None: ``RAY_ADDRESS`` or
    #: an already-connected Ray; the connector starts nothing local unless ``address="local"``.
    address: str | None = None
    #: KV bytes each node's block pool may hold (``"4GiB"`` or an int). Clamped to 80% of the
    #: node's object store when that is smaller.
    capacity: int = 1 << 30
    #: Which segments go first when a pool is full: ``lru``, ``probation`` (new puts wait in a
    #: small FIFO until read; ghosts of what it evicts) or ``adaptive`` (``probation`` whose FIFO
    #: share follows what LRU would have hit; :mod:`kvray.meta.eviction`).
    eviction_policy: str = "lru"
    #: Blocks are batched into objects of at most this many bytes (one Ray op costs ~1 ms).
    segment_bytes: int = 32 << 20
    #: Upper bound on bytes a client has handed to ``put`` and not yet stored; beyond it puts
    #: are refused (counted), never queued without bound.
    max_inflight_put_bytes: int = 512 << 20
    #: Verify an xxh3 checksum of every block on ``get``: a corrupt block is reported lost.
    verify_checksums: bool = True
    #: Every wait on Ray has a timeout: a get, a put, an actor call.
    get_timeout_s: float = 30.0
    put_timeout_s: float = 60.0
    #: How long a reader may keep a block leased (protected from eviction) before it expires.
    lease_timeout_s: float = 60.0
    #: How often the reconciler checks that every pool is alive and every alive node has one.
    health_check_interval_s: float = 1.0
    #: Index shards (actors that each own a range of block ids); 0: one per 16 nodes at start.
    index_shards: int = 0
    #: Connector: how long a load may hold up a step, plus its bytes at ``load_bytes_per_s``;
    #: blocks not loaded by then are reported failed and recomputed (a load never stalls the
    #: forward pass for ``get_timeout_s``).
    load_timeout_s: float = 0.5
    #: Connector: the slowest rate a load is given time for. Its deadline is
    #: ``load_timeout_s`` plus its bytes at this rate, so a large pull from another node's
    #: pool (256 MiB: +1 s) is not cut short and recomputed at many times its cost.
    load_bytes_per_s: int = 256 << 20
    #: Connector: ``sync`` loads hits inside ``start_load_kv``; ``layerwise`` (CPU caches)
    #: starts them there and copies one layer at a time while the forward pass runs, which
    #: waits per layer in ``wait_for_layer_load``; ``async`` loads them in the background and
    #: reports them through ``finished_recving`` (the request waits a step).
    load_mode: str = "sync"
    #: Connector: load only the part of a hit whose measured load time beats recomputing it
    #: (:mod:`kvray.connector.pricing`, issue 32); the rest is left to vLLM. Off: every hit is
    #: loaded (the costs are still measured and published for routers). Off by default until
    #: the serving matrix shows it never loses; on a tiny CPU model it declines most hits.
    price_loads: bool = False
    #: Connector: store a prompt's blocks only where an earlier prompt on this engine had them
    #: too (a doorkeeper: a prefix computed once is not stored, computed again it is); what a
    #: request decodes is stored when a later prompt holds it. ``"auto"`` (default): a
    #: prompt's first sightings are stored too while that pays by what the engine measures
    #: (the share of first sightings a later prompt needs again beyond vLLM's cache, their
    #: recompute, what a store takes from the engine and a load of them;
    #: :meth:`~kvray.connector.pricing.Pricing.first_sightings_pay`); every block is stored
    #: until those are measured (issue 32). False: every computed block is stored.
    store_seen_only: bool | str = "auto"
    #: Connector: bytes of reusable staging buffers per worker for saves and loads.
    staging_bytes: int = 256 << 20
    #: Connector: blocks a request fills while it decodes are stored once this many are full
    #: (or when it finishes), not one put per block; a prompt's blocks are stored at once.
    #: 1 stores every block as it fills. Each put costs ~4 ms of CPU across writer, pool and
    #: raylet whatever its size (``scripts/bench_save.py``).
    decode_store_blocks: int = 8
    #: Connector: start kvray in the namespace when it is not running yet.
    auto_start: bool = True
    #: Connector: model name used in the key namespace (default: vLLM's served model).
    model_id: str | None = None
    #: Extra, free-form labels mixed into the key namespace (e.g. a LoRA or weights revision).
    cache_salt: str = ""
    #: Local-disk tier: segments RAM evicts go to ``<disk_dir>/<namespace>/`` on each node (an
    #: absolute path) and survive pool restarts, ``kvray stop``/``start`` and reboots. None: no
    #: disk tier.
    disk_dir: str | None = None
    #: Bytes of segment files per node (``"500GiB"``); required with ``disk_dir``.
    disk_capacity: int = 0
    #: Spill only blocks read at least this many times (0: every block RAM evicts).
    disk_admit_min_hits: int = 0
    #: Connector: report what the engine's own KV cache holds (vLLM's KV events, taken in
    #: the scheduler, no ZMQ) to the index's engine tier, for routers; never a load source.
    engine_tier: bool = True

    _extra: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, least in _SIZE_FIELDS.items():
            object.__setattr__(self, name, parse_bytes(getattr(self, name), name, least=least))
        check_namespace(self.namespace)
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise ConfigError("address", self.address, "expected auto, local or HOST:PORT")
        if self.eviction_policy not in POLICIES:
            raise ConfigError("eviction_policy", self.eviction_policy, f"choose one of {POLICIES}")
        if self.max_inflight_put_bytes < self.segment_bytes:
            raise ConfigError(
                "max_inflight_put_bytes",
                self.max_inflight_put_bytes,
                f"must be at least segment_bytes ({self.segment_bytes})",
            )
        if (
            isinstance(self.index_shards, bool)
            or not isinstance(self.index_shards, int)
            or not 0 <= self.index_shards <= 64
        ):
            raise ConfigError("index_shards", self.index_shards, "expected 0 (auto) to 64")
        for name in (
            "get_timeout_s",
            "put_timeout_s",
            "lease_timeout_s",
            "health_check_interval_s",
            "load_timeout_s",
        ):
            v = check_number(getattr(self, name), name, high=3600, low_open=True, unit="seconds")
            object.__setattr__(self, name, v)
        v = self.decode_store_blocks
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 4096:
            raise ConfigError("decode_store_blocks", v, "expected a whole number in [1, 4096]")
        for name in (
            "verify_checksums",
            "auto_start",
            "engine_tier",
            "price_loads",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "expected true or false")
        v = self.store_seen_only
        if not (isinstance(v, bool) or v == "auto"):
            raise ConfigError("store_seen_only", v, 'expected true, false or "auto"')
        if self.load_mode not in _LOAD_MODES:
            raise ConfigError("load_mode", self.load_mode, f"choose one of {_LOAD_MODES}")
        if self.model_id is not None and not isinstance(self.model_id, str):
            raise ConfigError("model_id", self.model_id, "expected a string")
        if not isinstance(self.cache_salt, str):
            raise ConfigError("cache_salt", self.cache_salt, "expected a string")
        self._check_disk()

    def _check_disk(self) -> None:
        if self.disk_dir is None:
            if self.disk_capacity:
                raise ConfigError(
                    "disk_capacity", self.disk_capacity, "needs disk_dir (the disk tier's path)"
                )
        elif not isinstance(self.disk_dir, str) or not os.path.isabs(self.disk_dir):
            raise ConfigError("disk_dir", self.disk_dir, "expected an absolute path")
        elif "\0" in self.disk_dir:
            raise ConfigError("disk_dir", self.disk_dir, "contains a NUL byte")
        elif self.disk_capacity < MIN_CAPACITY:
            raise ConfigError(
                "disk_capacity",
                self.disk_capacity,
                "set it to at least 1 MiB (e.g. 100GiB) when disk_dir is set",
            )
        v = self.disk_admit_min_hits
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_ADMIT_HITS:
            raise ConfigError(
                "disk_admit_min_hits", v, f"expected an integer 0 to {MAX_ADMIT_HITS}"
            )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if not f.name.startswith("_"))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None = None, **overrides: Any) -> KVRayConfig:
        """Build from a mapping (e.g. ``kv_connector_extra_config``); unknown keys are errors.

        Values given as strings by a CLI or JSON (``"true"``, ``"2.5"``) are converted.
        """
        merged: dict[str, Any] = dict(values or {})
        merged.update({k: v for k, v in overrides.items() if v is not None})
        cls._check_known(merged)
        return cls(**{k: _coerce(cls, k, v) for k, v in merged.items()})

    def replace(self, **changes: Any) -> KVRayConfig:
        """A copy with ``changes`` applied and validated; unknown keys are errors."""
        self._check_known(changes)
        return dataclasses.replace(self, **changes)

    @classmethod
    def _check_known(cls, values: Mapping[str, Any]) -> None:
        known = cls.field_names()
        for key in values:
            if key not in known:
                raise ConfigError(key, values[key], f"unknown key; known keys: {sorted(known)}")

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.field_names()}


#: Switches that also take ``"auto"`` (decided by what the engine measures).
_AUTO_FIELDS = frozenset({"store_seen_only"})


def _coerce(cls: type[KVRayConfig], name: str, value: Any) -> Any:
    """Turn CLI/JSON strings into the field's type; anything odd is left for validation."""
    if not isinstance(value, str):
        return value
    default = next(f for f in fields(cls) if f.name == name).default
    if isinstance(default, bool) or name in _AUTO_FIELDS:
        low = value.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        if name in _AUTO_FIELDS:
            if low == "auto":
                return "auto"
            raise ConfigError(name, value, 'expected true, false or "auto"')
        raise ConfigError(name, value, "expected true or false")
    if isinstance(default, float):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(name, value, "expected a number of seconds") from None
    if isinstance(default, int) and name not in _SIZE_FIELDS:
        try:
            return int(value)
        except ValueError:
            raise ConfigError(name, value, "expected an integer") from None
    return value
