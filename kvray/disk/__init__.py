"""The local-disk tier of the block pools (issue 12): segments RAM evicts, in Arrow IPC files.

- :mod:`.tier`: :class:`DiskTier`, one pool's files: spill queue and writer thread, LRU within
  ``disk_capacity``, scan at start, memory-mapped reads, purge.
- :mod:`.segfile`: the file format (one segment per Arrow IPC file), atomic writes, validation.
- :mod:`.slot`: the directory a tier owns under ``<disk_dir>/<namespace>/`` (``flock``).
- :mod:`.writer`: the write path (groups of files, one fsync round).
- :mod:`.files`: what a tier holds, and the scan that finds it.
- :mod:`.payload`: segment payload forms, checksums, the admission rule.
- :mod:`.settings`: what a pool is told (:class:`DiskSettings`) and the files' fingerprint.

The pool's side (spill on eviction, promotion on read, registration after a restart) is in
:mod:`kvray.actors.tiering` and :mod:`kvray.actors.promote` (reads).
"""

from kvray.disk.files import DiskSegment
from kvray.disk.payload import admit
from kvray.disk.settings import DiskSettings, fingerprint
from kvray.disk.tier import DiskTier

__all__ = ["DiskSegment", "DiskSettings", "DiskTier", "admit", "fingerprint"]
