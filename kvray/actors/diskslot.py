"""Slots: the directory of one disk tier, owned through an exclusive ``flock``.

``<root>/<namespace>/<k>/`` is slot ``k``. A tier takes the first slot whose ``.lock`` it can
lock (``LOCK_EX | LOCK_NB``) and holds it for its life; the kernel releases the lock when the
process exits, however it exits. So two pools on one host (simulated Ray nodes) never share
files, and the single pool of a machine takes slot 0 again after a restart or a reboot and finds
its files. Lock files and slot directories are never deleted: deleting a lock file another
process has open would let two processes "hold" the same slot.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator

from kvray.errors import KVRayError

__all__ = ["MAX_SLOTS", "Slot", "unlink"]

#: Slots tried per namespace and host (one per concurrent pool process on the host).
MAX_SLOTS = 64
_SEGMENT_RE = re.compile(r"^([0-9a-f]{16})\.arrow$")
_TMP_SUFFIX = ".tmp"


def unlink(path: str) -> int:
    """Delete a file; 1 if it existed, 0 if not."""
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0


def _open_lock(path: str) -> int:
    return os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class Slot:
    """The slot directory this process holds under ``base`` (``<root>/<namespace>``)."""

    def __init__(self, base: str) -> None:
        self.base = base
        for k in range(MAX_SLOTS):
            path = os.path.join(base, str(k))
            os.makedirs(path, exist_ok=True)
            fd = _open_lock(path)
            if not _try_lock(fd):
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())  # for people, not for the lock
            self.dir = path
            self._fd = fd
            return
        raise KVRayError(f"kvray disk tier: all {MAX_SLOTS} slots under {base} are in use")

    def release(self) -> None:
        """Give up the slot (closing the descriptor drops the lock). Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def path(self, seg_id: int) -> str:
        return os.path.join(self.dir, f"{seg_id:016x}.arrow")

    def segments(self) -> list[tuple[int, str]]:
        """``(id, path)`` of every segment file name in the slot, in id order."""
        found = [
            (int(m.group(1), 16), os.path.join(self.dir, name))
            for name in os.listdir(self.dir)
            if (m := _SEGMENT_RE.match(name))
        ]
        return sorted(found)

    def delete_temporary(self) -> list[str]:
        """Delete the temporary files of interrupted writes; returns their names."""
        names = [n for n in os.listdir(self.dir) if n.endswith(".arrow" + _TMP_SUFFIX)]
        for name in names:
            unlink(os.path.join(self.dir, name))
        return names

    def purge(self) -> int:
        """Delete the segment files of this slot and of every slot no process holds."""
        deleted = _delete_segment_files(self.dir)
        for k in range(MAX_SLOTS):
            other = os.path.join(self.base, str(k))
            if other == self.dir or not os.path.isdir(other):
                continue
            with contextlib.suppress(OSError), _borrow(other) as held:
                if held:
                    deleted += _delete_segment_files(other)
        return deleted


@contextlib.contextmanager
def _borrow(path: str) -> Iterator[bool]:
    """Try to take another slot's lock for a moment; yields whether it was taken."""
    fd = _open_lock(path)
    try:
        yield _try_lock(fd)
    finally:
        os.close(fd)


def _delete_segment_files(path: str) -> int:
    deleted = 0
    for name in os.listdir(path):
        if _SEGMENT_RE.match(name) or name.endswith(".arrow" + _TMP_SUFFIX):
            deleted += unlink(os.path.join(path, name))
    return deleted
