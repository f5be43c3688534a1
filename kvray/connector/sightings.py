"""Which blocks this engine's earlier prompts had (config ``store_seen_only``, issue 32).

A doorkeeper for stores: a block is stored only once a prompt holds it that an earlier prompt
on this engine held too. A prefix computed once (a one-off prompt's tail, a long document
never asked about again) costs nothing in kvray; computed a second time (vLLM's own cache no
longer held it), it is stored and the third time is loaded. Two generations of Python's hashes
of the block hashes, each at most ``limit`` plus one prompt's blocks: bounded, and a hash
collision only stores a block one sighting early.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Sightings"]

#: Block hashes remembered per generation (two generations: 2-4 MB of sets at most).
LIMIT = 1 << 16


class Sightings:
    """The block hashes of the prompts this engine saw lately. One thread (the scheduler's)."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = max(1, limit)
        self._now: set[int] = set()
        self._before: set[int] = set()
        #: Blocks not stored because no earlier prompt had them (each counted once).
        self.skipped_blocks = 0

    def sight(self, block_hashes: Sequence[object]) -> int:
        """How many leading blocks of a prompt an earlier prompt had; then remembers them."""
        keys = [hash(h) for h in block_hashes]
        n = 0
        for k in keys:
            if k not in self._now and k not in self._before:
                break
            n += 1
        self._now.update(keys)
        if len(self._now) >= self.limit:
            self._before, self._now = self._now, set()
        return n

    def __len__(self) -> int:
        return len(self._now) + len(self._before)
