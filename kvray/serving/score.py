"""The router's score: what a replica saves of a prompt's prefill, against the load it carries.

For a prompt of ``n`` full blocks and a candidate replica, the prefix splits into tiers:

- ``engine``: leading blocks in the replica's own engine cache (vLLM's prefix cache: no load,
  no compute);
- ``local``: the next ones that kvray's pool on the replica's node holds (a zero-copy load);
- ``remote``: the next ones kvray holds only on another node (a cross-node pull);
- the rest is computed.

``score = (w_engine * engine + w_local * local + w_remote * remote) / n
          - w_queue * ongoing_requests - w_usage * engine_kv_usage``

Defaults (:class:`Weights`): ``engine`` 1.0 and ``local`` 0.8 are llm-d's precise-prefix
scorer's anchors (GPU hit 1.0, CPU tier 0.8); on this box a kvray hit of a 2,048-token prefix
costs ~0.11-0.2 s against vLLM's own hit 0.08 s and a 1.7-7.8 s recompute, so a local load is
worth most of an engine hit. ``remote`` 0.5: a cross-node pull moves the bytes at 0.5-0.8 GB/s
between simulated nodes, several times a local read. ``queue`` 0.25 per ongoing request: a
replica holding the whole prompt in its engine keeps it against a same-node replica (which
would load it from kvray: 0.2 of a prompt apart) until it has one more request in flight, and
against a cold replica until four; past that, waiting behind other requests costs more than
the prefill saved. Tuned on Ray's multi-turn benchmark (4 replicas on 2 cores, 8 sessions
starting together, medians of 2): 0.1 piled a burst behind one system prompt on one replica
while three idled (TTFT p50 1,717 ms); 0.25 gave 1,328 ms and 13% more output tokens a
second, computing 3% more prompt tokens. ``usage`` 0.2: a replica whose cache is full evicts
others' prefixes to take a new one. Scores within ``tie`` of the best are ties, broken by
power of two choices (the shorter queue of two sampled).

**The time model** (``score="ttft"``, :func:`pick_ttft`): no weights. Each engine publishes
its measured costs with the engine tier's heartbeat (:mod:`kvray.meta.costs`: its prefill
seconds per token and per step, its loads' fixed and per-token seconds from its node's pool
and from other nodes, the prefill it holds queued); the router predicts, per replica, the
seconds to the first token: the queue it holds (plus a mean request for each request sent to
it since its report), the load of what kvray holds for the prompt on its node and elsewhere
(only the part whose load beats its recompute, as the connector decides), one step and the
prefill of the rest. The least wins; predictions within :data:`TIE_S` (or :data:`TIE_REL` of
the best) are ties, broken by power of two choices. A replica that has published nothing
yet is predicted with the others' estimates and its own queue empty; when none has, the
weights above decide (kvray before any measurement).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from kvray.config import ConfigError, check_number
from kvray.meta.costs import Costs, predicted_ttft

__all__ = ["TIE_REL", "TIE_S", "Candidate", "Tiers", "Weights", "pick", "pick_ttft", "split_tiers"]

#: Predicted times to first token this close to the best are ties (seconds, or relative).
TIE_S = 0.005
TIE_REL = 0.05

_R = TypeVar("_R")


@dataclass(frozen=True)
class Weights:
    """The score's weights (``KVRayRouter``'s ``weights`` kwarg, by name)."""

    engine: float = 1.0
    local: float = 0.8
    remote: float = 0.5
    queue: float = 0.25
    usage: float = 0.2
    tie: float = 0.02

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(
                self, f.name, check_number(getattr(self, f.name), f"weights.{f.name}")
            )

    @classmethod
    def of(cls, values: Mapping[str, Any] | None) -> Weights:
        given = dict(values or {})
        names = {f.name for f in fields(cls)}
        for k, v in given.items():
            if k not in names:
                raise ConfigError(f"weights.{k}", v, f"known weights: {sorted(names)}")
        return cls(**given)


@dataclass(frozen=True)
class Candidate:
    """What the router knows of one replica for one prompt (blocks are leading blocks)."""

    engine: int = 0
    node_pool: int = 0
    anywhere: int = 0
    queue: float = 0.0
    usage: float = 0.0
    #: Its engine's published cost estimates (None: none yet).
    costs: Costs | None = None


@dataclass(frozen=True)
class Tiers:
    engine: int
    local: int
    remote: int
    computed: int


def split_tiers(total: int, c: Candidate) -> Tiers:
    """Where each of the prompt's ``total`` blocks would come from on replica ``c``."""
    e = min(c.engine, total)
    pool = min(c.node_pool, total)
    kv = min(max(c.anywhere, pool), total)
    local = max(0, pool - e)
    remote = max(0, kv - max(e, pool))
    return Tiers(e, local, remote, total - max(e, kv))


def weighted_hit(t: Tiers, w: Weights) -> float:
    """The weighted blocks a replica would not compute (the score's numerator)."""
    return w.engine * t.engine + w.local * t.local + w.remote * t.remote


def score(total: int, c: Candidate, w: Weights, t: Tiers | None = None) -> float:
    """``c``'s score for a prompt of ``total`` blocks (``t``: its tiers, if already split)."""
    if t is None:
        t = split_tiers(total, c)
    hit = weighted_hit(t, w) / total if total else 0.0
    return hit - w.queue * c.queue - w.usage * c.usage


def reason_of(t: Tiers) -> str:
    """The tier a decision rests on (metric ``kvray_router_decisions``' reason)."""
    if t.engine:
        return "engine"
    if t.local:
        return "kvray_node"
    if t.remote:
        return "kvray_remote"
    return "cold"


def pick(
    replicas: Sequence[_R],
    total: int,
    candidates: Sequence[Candidate],
    w: Weights,
    rng: random.Random | None = None,
) -> tuple[list[_R], str]:
    """Replicas best first, and the reason of the decision: the tier the chosen replica's
    prefix rests on, or ``balanced`` when load made another than the best hit win."""
    rng = rng or random
    tiers = [split_tiers(total, c) for c in candidates]
    scores = [score(total, c, w, t) for c, t in zip(candidates, tiers, strict=True)]
    best = max(scores)
    tied = [i for i, s in enumerate(scores) if s >= best - w.tie]
    if len(tied) > 1:  # power of two choices among the ties
        two = rng.sample(tied, 2)
        first = min(two, key=lambda i: (candidates[i].queue, scores[i] * -1))
    else:
        first = tied[0]
    rest = sorted((i for i in range(len(replicas)) if i != first), key=lambda i: -scores[i])
    order = [first, *rest]
    hit = [weighted_hit(t, w) for t in tiers]
    reason = reason_of(tiers[first])
    if hit[first] < max(hit):
        reason = "balanced"
    return [replicas[i] for i in order], reason


def _two_choices(tied: list[int], candidates: Sequence[Candidate], rng: random.Random) -> int:
    if len(tied) == 1:
        return tied[0]
    two = rng.sample(tied, 2)
    return min(two, key=lambda i: candidates[i].queue)


def predictions(total: int, candidates: Sequence[Candidate], block_size: int) -> list[float] | None:
    """Each candidate's predicted seconds to first token for a prompt of ``total`` blocks of
    ``block_size`` tokens; None when no candidate published estimates."""
    known = [c.costs for c in candidates if c.costs is not None and c.costs.warm]
    if not known:
        return None
    # A replica without estimates yet: the others' (the same model), its own queue empty.
    stand_in = sorted(known, key=lambda c: c.prefill_s_per_token or 0.0)[len(known) // 2]
    stand_in = Costs(**{**stand_in.__dict__, "queue_s": 0.0, "queue_reqs": 0.0})
    out = []
    for c in candidates:
        costs = c.costs if c.costs is not None and c.costs.warm else stand_in
        t = split_tiers(total, c)
        p = predicted_ttft(
            costs,
            local_tokens=t.local * block_size,
            remote_tokens=t.remote * block_size,
            computed_tokens=t.computed * block_size,
            unreported_reqs=max(0.0, c.queue - costs.queue_reqs),
        )
        out.append(p if p is not None else float("inf"))
    return out


def pick_ttft(
    replicas: Sequence[_R],
    total: int,
    candidates: Sequence[Candidate],
    block_size: int,
    rng: random.Random | None = None,
) -> tuple[list[_R], str] | None:
    """Replicas by least predicted time to first token, and the decision's reason (as
    :func:`pick`'s); None when no replica has published estimates (use :func:`pick`)."""
    preds = predictions(total, candidates, block_size)
    if preds is None:
        return None
    rng = rng or random
    best = min(preds)
    tied = [i for i, p in enumerate(preds) if p <= best + max(TIE_S, TIE_REL * best)]
    first = _two_choices(tied, candidates, rng)  # type: ignore[arg-type]
    rest = sorted((i for i in range(len(replicas)) if i != first), key=lambda i: preds[i])
    tiers = [split_tiers(total, c) for c in candidates]
    held = [t.engine + t.local + t.remote for t in tiers]
    reason = "balanced" if held[first] < max(held) else reason_of(tiers[first])
    return [replicas[i] for i in [first, *rest]], reason
