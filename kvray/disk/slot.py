"""Slots: the directory of one disk tier, owned through an exclusive ``flock``.

``<root>/<namespace>/<k>/`` is slot ``k``. A tier takes a slot whose ``.lock`` it can lock
(``LOCK_EX | LOCK_NB``) and holds it for its life; the kernel releases the lock when the process
exits, however it exits. So two pools on one host (simulated Ray nodes) never share files.
Which slot: the one whose lock file names the tier's ``owner`` (a pool passes its Ray node id),
waiting up to ``wait_s`` for a predecessor of that owner that is still exiting (an actor
restart, ``kvray stop`` then ``start``); else the first free one. So each simulated node finds
its own files again, and the single pool of a machine, whose node id changes with a reboot,
takes slot 0 again. Lock files and slot directories are never deleted: deleting a lock file
another process has open would let two processes "hold" the same slot.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
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


def _owner_of(path: str) -> str:
    """The owner named in a slot's lock file (second line; "" if none)."""
    try:
        with open(os.path.join(path, ".lock")) as f:
            lines = f.read(512).splitlines()
    except OSError:
        return ""
    return lines[1] if len(lines) > 1 else ""


class Slot:
    """The slot directory this process holds under ``base`` (``<root>/<namespace>``)."""

    def __init__(self, base: str, owner: str = "", wait_s: float = 10.0) -> None:
        self.base = base
        os.makedirs(base, exist_ok=True)
        if owner:
            for k in range(MAX_SLOTS):
                path = os.path.join(base, str(k))
                if os.path.isdir(path) and _owner_of(path) == owner and self._take(path, wait_s):
                    self._claim(owner)
                    return
        for k in range(MAX_SLOTS):
            path = os.path.join(base, str(k))
            os.makedirs(path, exist_ok=True)
            if self._take(path, 0.0):
                self._claim(owner)
                return
        raise KVRayError(f"kvray disk tier: all {MAX_SLOTS} slots under {base} are in use")

    def _take(self, path: str, wait_s: float) -> bool:
        fd = _open_lock(path)
        deadline = time.monotonic() + wait_s
        while not _try_lock(fd):
            if time.monotonic() >= deadline:
                os.close(fd)
                return False
            time.sleep(0.05)
        self.dir, self._fd = path, fd
        return True

    def _claim(self, owner: str) -> None:
        os.ftruncate(self._fd, 0)  # the pid is for people; the owner picks the slot next time
        os.pwrite(self._fd, f"{os.getpid()}\n{owner}\n".encode(), 0)

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
