"""What a block pool is told about its disk tier, from kvray's configuration.

``disk_dir`` unset: no tier. Otherwise each pool keeps up to ``disk_capacity`` bytes of segment
files under ``<disk_dir>/<namespace>/<slot>/`` and spills the segments RAM evicts there.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvray.config import KVRayConfig
from kvray.disk import segfile

__all__ = ["MAX_PENDING_BYTES", "DiskSettings", "fingerprint"]

#: Upper bound of the bytes on their way to disk (still in the object store, outside the RAM
#: capacity count): see :meth:`DiskSettings.from_config`.
MAX_PENDING_BYTES = 256 << 20
#: How block ids are derived from keys (:func:`kvray.meta.ids.key_ids`): files hold ids, so a
#: change of the derivation must change the fingerprint.
_IDS = "xxh3-64"


def fingerprint(namespace: str) -> str:
    """What a tier's files are validated against at start: the format and its version, the
    id derivation and the namespace (a file of another namespace or kvray is skipped)."""
    return f"{segfile.FORMAT}/v{segfile.VERSION}/ids={_IDS}/ns={namespace}"


@dataclass(frozen=True)
class DiskSettings:
    """A pool's disk tier: where, how big, what it admits and how much may be in flight.

    Built from a validated :class:`KVRayConfig`; :class:`~kvray.disk.tier.DiskTier` checks
    the sizes again with the same rules (:func:`kvray.config.parse_bytes`).
    """

    dir: str
    capacity: int
    admit_min_hits: int = 0
    max_pending_bytes: int = MAX_PENDING_BYTES

    @classmethod
    def from_config(cls, cfg: KVRayConfig) -> DiskSettings | None:
        """None without ``disk_dir``. Segments on their way to disk stay in the object store
        outside the RAM count: at most a quarter of ``capacity`` (the pool's capacity is at
        most 80% of the object store, so together they fit in it), but at least one segment
        (``segment_bytes``) and at most :data:`MAX_PENDING_BYTES`."""
        if cfg.disk_dir is None:
            return None
        pending = min(MAX_PENDING_BYTES, max(cfg.capacity // 4, cfg.segment_bytes))
        return cls(cfg.disk_dir, cfg.disk_capacity, cfg.disk_admit_min_hits, pending)

    @property
    def max_files(self) -> int:
        """Files the tier may hold: one per MiB of capacity, within 16Ki-256Ki (bounds the
        directory, the scan and the pool's metadata when segments are small)."""
        return min(1 << 18, max(1 << 14, self.capacity >> 20))
