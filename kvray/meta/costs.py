"""Every decision priced in time: decayed estimates of one engine's costs, the connector's
load-or-recompute choice and the router's predicted time to first token.

No Ray, no vLLM: the connector's scheduler feeds :class:`EngineCosts` from what vLLM and kvray
already report (the scheduled tokens of each step, the wall time between steps, the seconds
and blocks of each load), publishes its :class:`Costs` with the engine tier's heartbeat
(:meth:`Costs.to_wire`: a tuple of floats in :class:`~kvray.meta.messages.ReplicaInfo`), and
routers read them back from their view.

The model, per engine (every figure a decayed estimate; ``None``: not measured yet):

- a step takes ``step_s + prefill_tokens x prefill_s_per_token`` (a weighted least-squares
  line over recent steps: the intercept is the per-step cost of the batch's decodes and
  overheads, the slope the marginal cost of a prompt token at the batch the engine runs; both
  are wall time, so cores shared with other engines on the node are in them);
- a load from a tier (``local``: the pool on the engine's node; ``remote``: pools elsewhere)
  takes ``fixed_s + tokens x s_per_token`` (a line per tier over recent loads; a load that
  timed out counts with the seconds it waited);
- decode-only steps fitted as ``decode_step_s`` for one request plus ``decode_s_per_req``
  for each more: what every request the engine runs adds to each step of a new prefill;
- the queue: prompt tokens the engine knows and has not computed (``queue_s``, already priced
  at its prefill rate), the requests it holds (``queue_reqs``) and what a request's prefill
  costs on average (``req_s``), for requests a router sent after the engine's last report.

**Load or recompute** (:func:`tokens_to_load`): a hit is a run of blocks per tier; loading its
first ``k`` tokens costs the load line of each tier used, recomputing the rest costs
``prefill_s_per_token`` each; the connector loads the ``k`` (a tier boundary, 0 or all) with
the least total. Without a prefill estimate, or for a tier without a load estimate, it loads
(kvray's behaviour before any measurement).

**Time to first token** (:func:`predicted_ttft`): ``queue wait + the requests it runs x
decode_s_per_req + load of what kvray holds for the prompt (as the connector would choose) +
step_s + prefill of the rest``; the engine's own prefix cache costs nothing.

Decay: each sample's weight halves every ``half_life_s``; an estimate whose total weight fell
below ``min_weight`` is unknown again. So a path that was slow once is tried again after a
while (the connector declines loads from it meanwhile and learns nothing new of it), and a
slow period's samples stop counting as newer ones arrive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

__all__ = [
    "HALF_LIFE_S",
    "MIN_WEIGHT",
    "TIERS",
    "Costs",
    "Decayed",
    "DecayedLine",
    "EngineCosts",
    "LoadLine",
    "predicted_ttft",
    "tokens_to_load",
]

#: A sample's weight halves this often (seconds).
HALF_LIFE_S = 10.0
#: Below this total weight an estimate is unknown (one sample: after one half-life).
MIN_WEIGHT = 0.5
#: Load source tiers: the pool on the engine's node, pools on other nodes.
TIERS = ("local", "remote")
#: Longest a sample may say one step or one load took (a stall past it is clipped).
MAX_SAMPLE_S = 60.0
#: A line's slope is fitted only when its x values spread this much (relative); otherwise
#: the estimate is the ratio of the sums (no fixed part).
MIN_SPREAD = 0.1


def _decay(half_life_s: float, dt: float) -> float:
    return 0.5 ** (max(0.0, dt) / half_life_s) if half_life_s > 0 else 0.0


class Decayed:
    """A weighted mean whose samples' weights halve every ``half_life_s``."""

    __slots__ = ("_t", "_w", "_wy", "half_life_s", "min_weight")

    def __init__(self, half_life_s: float = HALF_LIFE_S, min_weight: float = MIN_WEIGHT) -> None:
        self.half_life_s = half_life_s
        self.min_weight = min_weight
        self._t = 0.0
        self._w = 0.0
        self._wy = 0.0

    def _age(self, now: float) -> None:
        if now > self._t:
            f = _decay(self.half_life_s, now - self._t)
            self._w *= f
            self._wy *= f
            self._t = now

    def observe(self, y: float, now: float, weight: float = 1.0) -> None:
        if not (math.isfinite(y) and math.isfinite(weight)) or weight <= 0:
            return
        self._age(now)
        self._w += weight
        self._wy += weight * min(max(y, 0.0), MAX_SAMPLE_S)

    def weight(self, now: float) -> float:
        return self._w * _decay(self.half_life_s, now - self._t)

    def value(self, now: float) -> float | None:
        """The mean, or None when too little weight is left."""
        if self.weight(now) < self.min_weight:
            return None
        return self._wy / self._w if self._w > 0 else None


class DecayedLine:
    """``y = a + b x`` by decayed weighted least squares (``a, b >= 0``)."""

    __slots__ = ("_s", "_t", "half_life_s", "min_weight")

    def __init__(self, half_life_s: float = HALF_LIFE_S, min_weight: float = MIN_WEIGHT) -> None:
        self.half_life_s = half_life_s
        self.min_weight = min_weight
        self._t = 0.0
        self._s = [0.0] * 5  # w, wx, wy, wxx, wxy

    def observe(self, x: float, y: float, now: float, weight: float = 1.0) -> None:
        if not (math.isfinite(x) and math.isfinite(y) and math.isfinite(weight)):
            return
        if weight <= 0 or x < 0:
            return
        y = min(max(y, 0.0), MAX_SAMPLE_S)
        if now > self._t:
            f = _decay(self.half_life_s, now - self._t)
            self._s = [v * f for v in self._s]
            self._t = now
        s = self._s
        s[0] += weight
        s[1] += weight * x
        s[2] += weight * y
        s[3] += weight * x * x
        s[4] += weight * x * y

    def weight(self, now: float) -> float:
        return self._s[0] * _decay(self.half_life_s, now - self._t)

    def fit(self, now: float) -> tuple[float, float] | None:
        """``(a, b)``, or None when too little weight is left or no x was positive."""
        w, wx, wy, wxx, wxy = self._s
        if w <= 0 or self.weight(now) < self.min_weight or wx <= 0:
            return None
        mx, my = wx / w, wy / w
        var = wxx / w - mx * mx
        if var > (MIN_SPREAD * mx) ** 2:
            b = (wxy / w - mx * my) / var
            a = my - b * mx
            if b > 0 and a >= 0:
                return a, b
            if b > 0:  # a negative intercept: the line through the origin's slope
                return 0.0, wxy / wxx
        return 0.0, wy / wx


@dataclass(frozen=True)
class LoadLine:
    """What a load from one tier costs: ``fixed_s + tokens x s_per_token``."""

    fixed_s: float
    s_per_token: float

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + tokens * self.s_per_token if tokens > 0 else 0.0


#: An unknown estimate on the wire (not NaN: NaN != NaN would make every report look new
#: to the index, which then wakes every router's feed).
UNKNOWN = -1.0


@dataclass(frozen=True)
class Costs:
    """One engine's published estimates (None: not measured). A few floats on the wire."""

    prefill_s_per_token: float | None = None
    step_s: float | None = None
    decode_step_s: float | None = None
    local_fixed_s: float | None = None
    local_s_per_token: float | None = None
    remote_fixed_s: float | None = None
    remote_s_per_token: float | None = None
    #: Predicted seconds of prefill the engine holds (its known uncomputed prompt tokens).
    queue_s: float = 0.0
    #: Requests the engine holds (running or waiting, as its connector knows them).
    queue_reqs: float = 0.0
    #: A request's prefill on average (seconds, at the engine's prefill rate).
    req_s: float | None = None
    #: What each request decoding in the batch adds to a step (seconds; the slope of
    #: decode-only steps' time over their requests).
    decode_s_per_req: float | None = None

    def load(self, tier: str) -> LoadLine | None:
        fixed = getattr(self, f"{tier}_fixed_s", None)
        per = getattr(self, f"{tier}_s_per_token", None)
        if fixed is None or per is None:
            return None
        return LoadLine(fixed, per)

    @property
    def warm(self) -> bool:
        """Enough is known to predict a prefill."""
        return self.prefill_s_per_token is not None and self.step_s is not None

    def to_wire(self) -> tuple[float, ...]:
        """Floats in field order, :data:`UNKNOWN` (-1) for unknown, 3 significant digits (a
        report whose figures did not change compares equal: the index wakes no feed)."""
        out = []
        for f in fields(self):
            v = getattr(self, f.name)
            out.append(UNKNOWN if v is None else float(f"{v:.3g}"))
        return tuple(out)

    @classmethod
    def from_wire(cls, values: Sequence[float] | None) -> Costs | None:
        """Read a published tuple (None: nothing published, e.g. an older engine). Fields past
        the tuple's end keep their defaults; extra values (a newer engine) are ignored."""
        if not values:
            return None
        kw: dict[str, float | None] = {}
        for f, v in zip(fields(cls), values, strict=False):
            try:
                x = float(v)
            except (TypeError, ValueError):
                return None
            if x == UNKNOWN:
                if f.default is None:
                    kw[f.name] = None
                continue
            if not math.isfinite(x) or x < 0:
                return None
            kw[f.name] = x
        return cls(**kw)  # type: ignore[arg-type]


def tokens_to_load(runs: Sequence[tuple[str, int]], costs: Costs | None) -> int:
    """How many leading tokens of a hit to load: ``runs`` are consecutive ``(tier, tokens)``
    of the hit in order; the answer is the prefix whose load plus the recompute of the rest
    is the least (ties: the longer load). Loads everything without a prefill estimate; a
    tier with no load estimate is taken as free (as before any measurement)."""
    total = sum(max(0, n) for _, n in runs)
    if costs is None or costs.prefill_s_per_token is None or total <= 0:
        return total
    per = costs.prefill_s_per_token
    best_k, best = 0, total * per
    k, load_tokens = 0, {t: 0 for t in TIERS}
    for tier, n in runs:
        if n <= 0:
            continue
        k += n
        load_tokens[tier] = load_tokens.get(tier, 0) + n
        cost = _load_seconds(load_tokens, costs) + (total - k) * per
        if cost <= best:
            best_k, best = k, cost
    return best_k


def _load_seconds(tokens: dict[str, int], costs: Costs) -> float:
    """A load's seconds: the tiers it reads from are read one after the other."""
    s = 0.0
    for tier, n in tokens.items():
        line = costs.load(tier)
        if line is not None:
            s += line.seconds(n)
    return s


def load_or_recompute_s(runs: Sequence[tuple[str, int]], costs: Costs) -> float:
    """Seconds the connector spends on a hit: the load it chooses, and recomputing the rest."""
    total = sum(max(0, n) for _, n in runs)
    k = tokens_to_load(runs, costs)
    loaded: dict[str, int] = {}
    left = k
    for tier, n in runs:
        take = min(max(0, n), left)
        if take:
            loaded[tier] = loaded.get(tier, 0) + take
        left -= take
    per = costs.prefill_s_per_token or 0.0
    return _load_seconds(loaded, costs) + (total - k) * per


def predicted_ttft(
    costs: Costs,
    *,
    local_tokens: int,
    remote_tokens: int,
    computed_tokens: int,
    unreported_reqs: float = 0.0,
) -> float | None:
    """Predicted seconds to the first token of a prompt on this engine: the queue it holds
    (plus ``unreported_reqs`` requests sent to it since its report, each a mean request), the
    load of what kvray holds (``local_tokens`` on its node, then ``remote_tokens`` elsewhere;
    the part that pays, see :func:`tokens_to_load`), one step and the prefill of
    ``computed_tokens``. None when the engine's prefill is not measured yet."""
    if not costs.warm:
        return None
    per = costs.prefill_s_per_token or 0.0
    step = costs.step_s or 0.0
    mean_req = costs.req_s if costs.req_s is not None else step + computed_tokens * per
    wait = costs.queue_s + max(0.0, unreported_reqs) * mean_req
    # the requests it runs share every step with this prompt's prefill
    batch = (costs.decode_s_per_req or 0.0) * (costs.queue_reqs + max(0.0, unreported_reqs))
    runs = [("local", local_tokens), ("remote", remote_tokens)]
    hit = load_or_recompute_s(runs, costs)
    return wait + batch + hit + step + max(0, computed_tokens) * per


class EngineCosts:
    """The scheduler side's estimates for its own engine (one thread writes them; the
    published :class:`Costs` is an immutable value any thread may read)."""

    def __init__(self, half_life_s: float = HALF_LIFE_S, min_weight: float = MIN_WEIGHT) -> None:
        self.step = DecayedLine(half_life_s, min_weight)
        self.decode = DecayedLine(half_life_s, min_weight)
        self.req_tokens = Decayed(half_life_s, min_weight)
        self.loads = {t: DecayedLine(half_life_s, min_weight) for t in TIERS}
        self.queue_tokens = 0.0
        self.queue_reqs = 0.0

    def observe_step(
        self, prefill_tokens: int, seconds: float, now: float, decode_reqs: int = 0
    ) -> None:
        """A step that computed ``prefill_tokens`` prompt tokens and ``decode_reqs`` requests'
        next tokens in ``seconds`` of wall time (its loads taken out)."""
        self.step.observe(prefill_tokens, seconds, now)
        if prefill_tokens == 0 and decode_reqs > 0:
            self.decode.observe(decode_reqs, seconds, now)

    def observe_load(self, tier: str, tokens: int, seconds: float, now: float, n: int = 1) -> None:
        """``n`` loads from ``tier`` of ``tokens`` tokens each (on average) that took
        ``seconds`` each (on average)."""
        line = self.loads.get(tier)
        if line is not None and tokens > 0:
            line.observe(tokens, seconds, now, weight=float(max(1, n)))

    def observe_request(self, tokens_to_compute: int, now: float) -> None:
        """A request's prompt tokens left to compute once its hits were found."""
        self.req_tokens.observe(tokens_to_compute, now)

    def set_queue(self, tokens: float, reqs: float) -> None:
        self.queue_tokens, self.queue_reqs = max(0.0, tokens), max(0.0, reqs)

    def costs(self, now: float) -> Costs:
        fit = self.step.fit(now)
        step_s, per = fit if fit is not None else (None, None)
        kw: dict[str, float | None] = {}
        for tier, line in self.loads.items():
            lf = line.fit(now)
            kw[f"{tier}_fixed_s"] = lf[0] if lf is not None else None
            kw[f"{tier}_s_per_token"] = lf[1] if lf is not None else None
        req = self.req_tokens.value(now)
        dec = self.decode.fit(now)
        return Costs(
            prefill_s_per_token=per,
            step_s=step_s,
            decode_step_s=(dec[0] + dec[1]) if dec is not None else None,
            decode_s_per_req=dec[1] if dec is not None else None,
            queue_s=self.queue_tokens * per if per is not None else 0.0,
            queue_reqs=self.queue_reqs,
            req_s=(step_s or 0.0) + req * per if (req is not None and per is not None) else None,
            **kw,
        )
