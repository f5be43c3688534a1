"""The router's memory of what it just sent where (:mod:`kvray.serving.inflight`), no cluster.

A burst of prompts sharing a prefix that no cache holds yet must go to one replica (vLLM shares
a prefix already scheduled on the same engine), not each to its own replica to compute it again;
the memory expires, is bounded, and the queue still spreads a long burst.
"""

from __future__ import annotations

import random
import threading

import pytest

from kvray.config import ConfigError
from kvray.serving.inflight import InFlight, Unsent
from kvray.serving.score import Candidate, Weights, pick


def test_leading_blocks_routed_to_each_replica_until_they_expire() -> None:
    mem = InFlight(ttl_s=3.0)
    mem.note("a", [1, 2, 3, 4], now=10.0)
    mem.note("b", [1, 2, 9], now=11.0)
    assert mem.prefix([1, 2, 3, 4, 5], now=11.5) == {"a": 4, "b": 2}
    assert mem.prefix([1, 2, 9], now=11.5) == {"a": 2, "b": 3}
    assert mem.prefix([7, 1, 2], now=11.5) == {}  # leading blocks only
    # a's entries expire at 13.0, b's at 14.0
    assert mem.prefix([1, 2, 3], now=13.5) == {"b": 2}
    assert mem.prefix([1, 2, 3], now=14.0) == {}
    # Noting a block again extends it: the older entry does not expire the newer one.
    mem.note("a", [1], now=12.9)
    mem.note("a", [1], now=15.0)
    assert mem.prefix([1], now=17.0) == {"a": 1}
    assert mem.prefix([1], now=18.0) == {}


def test_bounded_and_off() -> None:
    mem = InFlight(ttl_s=60.0, max_blocks=100)
    for r in range(50):
        mem.note(f"r{r}", list(range(r * 10, r * 10 + 10)), now=float(r) / 100)
    assert len(mem) == 100
    assert mem.prefix(list(range(490, 500)), now=1.0) == {"r49": 10}
    assert mem.prefix(list(range(0, 10)), now=1.0) == {}  # dropped, oldest first
    assert sum(len(h) for h in mem._holders.values()) == 100
    off = InFlight(ttl_s=0)
    off.note("a", [1, 2], now=0.0)
    assert len(off) == 0 and off.prefix([1, 2], now=0.0) == {}
    with pytest.raises(ValueError):
        InFlight(ttl_s=-1)
    for bad in (float("nan"), float("inf"), True, "3"):
        with pytest.raises(ConfigError, match="inflight_s"):
            InFlight(ttl_s=bad)  # type: ignore[arg-type]


def test_a_burst_sharing_a_cold_prefix_stays_on_one_replica_until_its_queue_is_long() -> None:
    """Ten prompts (a 28-block shared prefix, 7 blocks each of their own) arrive together on
    4 idle replicas: the first goes anywhere, the next ones follow it while its queue is
    short, then the next goes to an idle replica, and the one after follows that (two copies
    of the prefix computed, not one per request)."""
    reps = ["r0", "r1", "r2", "r3"]
    w = Weights()
    mem = InFlight()
    queues = dict.fromkeys(reps, 0)
    chosen = []
    rng = random.Random(0)
    for i in range(10):
        ids = list(range(28)) + [1000 + 10 * i + k for k in range(7)]
        routed = mem.prefix(ids, now=0.0)
        cands = [Candidate(engine=routed.get(r, 0), queue=queues[r]) for r in reps]
        order, _ = pick(reps, len(ids), cands, w, rng)
        mem.note(order[0], ids, now=0.0)
        queues[order[0]] += 1
        chosen.append(order[0])
    first = chosen[0]
    # 0.8 of the prompt in its engine against a cold replica: it keeps the prefix until it has
    # 4 more requests than an idle replica (queue weight 0.25).
    assert chosen[:4] == [first] * 4
    assert chosen[4] != first and chosen[5] == chosen[4]
    # Without the memory the same burst spreads: each replica computes the prefix.
    queues = dict.fromkeys(reps, 0)
    spread = set()
    for _ in range(8):
        order, reason = pick(reps, 35, [Candidate(queue=queues[r]) for r in reps], w, rng)
        assert reason == "cold"
        queues[order[0]] += 1
        spread.add(order[0])
    assert len(spread) >= 3


def test_concurrent_notes_and_lookups() -> None:
    mem = InFlight(ttl_s=0.05, max_blocks=1000)
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for n in range(2000):
                ids = [rng.randrange(50) for _ in range(8)]
                mem.note(f"r{seed}", ids, now=n * 0.001)
                mem.prefix(ids, now=n * 0.001)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(mem) <= 1000


def test_unsent_decisions_count_until_serve_counts_them() -> None:
    """A replica's decisions count in its queue from the moment the router makes them until
    Serve counts the request (its send, or the replica's answer), or ``ttl_s`` if it never
    does."""
    u = Unsent(ttl_s=1.0)
    u.chosen("a", now=0.0)
    u.chosen("a", now=0.1)
    u.chosen("b", now=0.1)
    assert (u.pending("a", 0.2), u.pending("b", 0.2), u.pending("c", 0.2)) == (2, 1, 0)
    u.sent("a")  # Serve's +1 replaces the oldest
    assert u.pending("a", 0.2) == 1 and len(u) == 3
    u.answered("a")  # the replica's count settles the one sent
    assert u.pending("a", 0.2) == 1 and len(u) == 2
    u.answered("b")  # choose_replica's reservation: answered, never sent
    assert u.pending("b", 0.2) == 0
    u.sent("c")  # a send the router did not decide (its fallback): nothing to take back
    u.answered("c")
    assert len(u) == 1
    assert u.pending("a", 1.05) == 1  # the one left was made at 0.1
    assert u.pending("a", 1.2) == 0 and len(u) == 0
    small = Unsent(ttl_s=10.0, max_entries=8)
    for i in range(100):
        small.chosen("hot" if i % 2 else f"r{i}", now=0.0)
    assert len(small) <= 8


def test_a_burst_routed_before_any_send_spreads_by_the_routers_own_count() -> None:
    """Serve counts a request in a replica's queue only when it sends it: a burst routed
    before any send sees every queue at 0. With the decisions not yet sent added, cold
    prompts alternate between replicas instead of piling on one by chance."""
    reps = ["r0", "r1"]
    w = Weights()
    u = Unsent()
    rng = random.Random(1)
    chosen = []
    for _ in range(12):
        cands = [Candidate(queue=u.pending(r, 0.0)) for r in reps]
        order, reason = pick(reps, 10, cands, w, rng)
        assert reason == "cold"
        u.chosen(order[0], 0.0)
        chosen.append(order[0])
    assert chosen.count("r0") == chosen.count("r1") == 6
