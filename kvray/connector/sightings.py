"""Which blocks this engine's earlier prompts had, and how often a block computed for the
first time is needed again (config ``store_seen_only``, issue 32).

A doorkeeper for stores: a block is stored only once a prompt holds it that an earlier prompt
on this engine held too. A prefix computed once (a one-off prompt's tail, a long document
never asked about again) costs nothing in kvray; computed a second time (vLLM's own cache no
longer held it), it is stored and the third time is loaded. Two generations of Python's hashes
of the block hashes, each at most ``limit`` plus one prompt's blocks: bounded, and a hash
collision only stores a block one sighting early.

With ``store_seen_only="auto"`` the doorkeeper is priced: :attr:`Sightings.reuse` is the
share of the blocks prompts held for the first time that a later prompt needed again beyond
what vLLM's own cache had (each block counted once; a decayed ratio of counts, starting from a
prior of ``PRIOR_BLOCKS`` that all came back, since returns lag first sightings), measured the
same whether first sightings are stored or not, so the choice never blinds its own evidence.
It is kept apart for the two kinds of prompt a block can first be seen in
(:meth:`Sightings.reuse_of`): one continuing a prefix earlier prompts had, and one sharing
nothing with them. Where one-off questions follow shared documents, the documents' first
sightings come back and the questions' never do; one ratio over both stored every question.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Sightings"]

#: Block hashes remembered per generation (two generations: ~74 B a hash, ~10 MB at most).
LIMIT = 1 << 16
#: The reuse ratio's counts halve each time this many first sightings were added.
HALF_BLOCKS = 4096
#: The reuse ratio starts from this many first sightings that all came back (a prior:
#: stores are made, as before any measurement, until evidence outweighs it).
PRIOR_BLOCKS = 64
#: Kinds of prompt a block is first seen in: one that shares nothing with the engine's
#: earlier prompts, and one that continues a prefix an earlier prompt had (a conversation's
#: next turn, a shared system prompt or document with a question of its own after it).
FRESH, CONTINUED = 0, 1


class _Generations:
    """Hashes in two generations of at most ``limit`` each (bounded), each with the kind of
    prompt that held it first (:data:`FRESH` or :data:`CONTINUED`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.now: dict[int, int] = {}
        self.before: dict[int, int] = {}

    def __contains__(self, key: int) -> bool:
        return key in self.now or key in self.before

    def kind(self, key: int) -> int:
        got = self.now.get(key)
        return self.before.get(key, FRESH) if got is None else got

    def add_all(self, keys: Sequence[int], kind: int = FRESH) -> None:
        """Remember ``keys``; one new here is of ``kind``, one known keeps its own."""
        now, before = self.now, self.before
        for k in keys:
            if k not in now:
                now[k] = before.get(k, kind)
        if len(now) >= self.limit:
            self.before, self.now = self.now, {}

    def __len__(self) -> int:
        return len(self.now) + len(self.before)


class Sightings:
    """The block hashes of the prompts this engine saw lately. One thread (the scheduler's)."""

    def __init__(
        self,
        limit: int = LIMIT,
        *,
        half_blocks: int = HALF_BLOCKS,
        prior_blocks: int = PRIOR_BLOCKS,
    ) -> None:
        self.limit = max(1, limit)
        self.prior_blocks = max(0, prior_blocks)
        self._seen = _Generations(self.limit)
        self._returned = _Generations(self.limit)
        self.half_blocks = max(1, half_blocks)
        # Decayed, per kind of the prompt that first held them: blocks held by a prompt for
        # the first time, and of them, those needed again beyond vLLM's cache.
        self._first = [0.0, 0.0]
        self._returns = [0.0, 0.0]
        self._since_halved = 0
        #: Blocks not stored because no earlier prompt had them (each counted once).
        self.skipped_blocks = 0
        #: Totals (not decayed): first sightings, and returns of them beyond vLLM's cache.
        self.first_blocks = 0
        self.returned_blocks = 0

    def sight(self, block_hashes: Sequence[object], local_blocks: int = 0) -> int:
        """How many leading blocks of a prompt an earlier prompt had; then remembers them.
        ``local_blocks``: the leading blocks vLLM's own cache holds for it (those are not
        needed from kvray, so they do not count as a return)."""
        keys = [hash(h) for h in block_hashes]
        seen = self._seen
        n = 0
        for k in keys:
            if k not in seen:
                break
            n += 1
        back = [k for k in keys[max(0, local_blocks) : n] if k not in self._returned]
        kind = CONTINUED if n else FRESH
        first = sum(1 for k in keys[n:] if k not in seen)
        for k in back:
            self._returns[seen.kind(k)] += 1
        if back:
            self._returned.add_all(back)
        seen.add_all(keys, kind)
        self.first_blocks += first
        self.returned_blocks += len(back)
        self._first[kind] += first
        self._since_halved += first
        if self._since_halved >= self.half_blocks:
            self._since_halved = 0
            self._first = [x / 2 for x in self._first]
            self._returns = [x / 2 for x in self._returns]
        return n

    @property
    def reuse(self) -> float | None:
        """Of the blocks prompts held for the first time lately, the share a later prompt
        needed again beyond vLLM's own cache, counting ``prior_blocks`` more that all came
        back (None: nothing counted and no prior)."""
        return self._share(sum(self._first), sum(self._returns))

    def reuse_of(self, continued: bool) -> float | None:
        """:attr:`reuse` of the blocks first held by prompts of one kind: those that continue
        a prefix an earlier prompt had (``continued``), or those that share nothing with
        earlier prompts. Where the two differ (one-off questions after shared documents:
        the documents come back, the questions never), each is priced on its own evidence;
        each kind starts from its own prior."""
        kind = CONTINUED if continued else FRESH
        return self._share(self._first[kind], self._returns[kind])

    def _share(self, first: float, returns: float) -> float | None:
        first += self.prior_blocks
        if first <= 0:
            return None
        return min(1.0, (returns + self.prior_blocks) / first)

    def __len__(self) -> int:
        return len(self._seen)
