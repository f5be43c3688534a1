"""The cost model (issue 32), built directly: no Ray, no vLLM."""

from __future__ import annotations

import math

import pytest

from kvray.meta.costs import (
    HALF_LIFE_S,
    Costs,
    Decayed,
    DecayedLine,
    EngineCosts,
    predicted_ttft,
    tokens_to_load,
)


def test_decayed_mean_forgets_and_expires() -> None:
    d = Decayed(half_life_s=10.0, min_weight=0.5)
    assert d.value(0.0) is None  # cold: unknown
    for t in range(5):
        d.observe(1.0, float(t))
    assert d.value(5.0) == pytest.approx(1.0)
    # a slow period, then fast samples again: the slow ones stop counting
    for t in range(5, 10):
        d.observe(10.0, float(t))
    slow = d.value(10.0)
    assert slow is not None and slow > 5.0
    for t in range(10, 60):
        d.observe(1.0, float(t))
    recovered = d.value(60.0)
    assert recovered is not None and recovered < 1.2  # from 10 s a sample to ~1
    # nothing observed for long: unknown again (cold start's behaviour)
    assert d.value(60.0 + 10 * 10.0) is None


def test_decayed_line_fits_intercept_and_slope() -> None:
    line = DecayedLine()
    for i in range(40):
        x = (i % 4) * 500
        line.observe(x, 0.02 + x * 1e-4, float(i) * 0.01)
    fit = line.fit(0.5)
    assert fit is not None
    a, b = fit
    assert a == pytest.approx(0.02, rel=1e-6) and b == pytest.approx(1e-4, rel=1e-6)


def test_decayed_line_without_spread_is_a_ratio() -> None:
    line = DecayedLine()
    for i in range(10):
        line.observe(1000, 0.5, float(i))
    assert line.fit(10.0) == (0.0, pytest.approx(5e-4))
    assert DecayedLine().fit(0.0) is None
    line.observe(float("nan"), 1.0, 11.0)  # refused, not propagated
    fit = line.fit(11.0)
    assert fit is not None and math.isfinite(fit[1])


def test_engine_costs_cold_then_warm() -> None:
    ec = EngineCosts()
    cold = ec.costs(0.0)
    assert not cold.warm and cold.load("local") is None
    assert tokens_to_load([("local", 1024)], cold) == 1024  # cold: today's behaviour
    for i in range(20):
        p = 0 if i % 2 else 1024
        ec.observe_step(p, 0.01 + p * 2e-4, i * 0.05)
    ec.observe_load("local", 1024, 0.05, 1.0)
    ec.observe_load("local", 512, 0.03, 1.0)
    c = ec.costs(1.0)
    assert c.warm and c.prefill_s_per_token == pytest.approx(2e-4)
    line = c.load("local")
    assert line is not None and line.s_per_token == pytest.approx(0.02 / 512)


def test_load_wins_when_cheaper_than_recompute() -> None:
    costs = Costs(
        prefill_s_per_token=2e-4, step_s=0.01, local_fixed_s=0.005, local_s_per_token=2e-5
    )
    assert tokens_to_load([("local", 1500)], costs) == 1500


def test_recompute_wins_when_the_load_path_is_slow() -> None:
    """The kv-heavy shape: 12 MiB at a slow pool's rate costs more than 1,500 tokens of a
    small model's prefill: recompute everything."""
    costs = Costs(prefill_s_per_token=5e-5, step_s=0.01, local_fixed_s=0.01, local_s_per_token=1e-4)
    assert tokens_to_load([("local", 1500)], costs) == 0


def test_partial_load_local_part_only() -> None:
    """Local blocks are cheap, remote ones slow: load the local part, recompute the rest."""
    costs = Costs(
        prefill_s_per_token=1e-4,
        step_s=0.01,
        local_fixed_s=0.002,
        local_s_per_token=1e-5,
        remote_fixed_s=0.05,
        remote_s_per_token=5e-4,
    )
    assert tokens_to_load([("local", 1024), ("remote", 512)], costs) == 1024
    # a remote tier never measured counts as free: loaded as before
    unknown_remote = Costs(prefill_s_per_token=1e-4, step_s=0.01)
    assert tokens_to_load([("local", 1024), ("remote", 512)], unknown_remote) == 1536


def test_slow_period_declines_then_recovers() -> None:
    """A pool that was slow: loads declined; once its samples decay the connector tries it
    again (cold), and fast samples make loading win."""
    ec = EngineCosts()
    for i in range(10):
        ec.observe_step(1000 if i % 2 else 0, 0.01 + (1000 if i % 2 else 0) * 1e-4, i * 0.1)
    for i in range(5):
        ec.observe_load("local", 1000, 0.5, 1.0 + i * 0.1)  # 0.5 s a load: slower than 0.1 s
    assert tokens_to_load([("local", 1000)], ec.costs(2.0)) == 0
    # steps keep coming (the engine is busy), no load is tried: the slow samples expire
    t = 2.0
    while t < 2.0 + 6 * HALF_LIFE_S:
        ec.observe_step(1000, 0.11, t)
        ec.observe_step(0, 0.01, t + 0.05)
        t += 0.1
    later = ec.costs(t)
    assert later.load("local") is None
    assert tokens_to_load([("local", 1000)], later) == 1000  # tried again
    for i in range(5):
        ec.observe_load("local", 1000, 0.01, t + i * 0.1)
    assert tokens_to_load([("local", 1000)], ec.costs(t + 1.0)) == 1000


def test_wire_round_trip_and_older_readers() -> None:
    c = Costs(prefill_s_per_token=1.234567e-4, step_s=0.01, queue_s=0.5, queue_reqs=2)
    wire = c.to_wire()
    assert len(wire) <= 12 and all(isinstance(v, float) for v in wire)
    back = Costs.from_wire(wire)
    assert back is not None
    assert back.prefill_s_per_token == pytest.approx(1.23e-4)
    assert back.local_fixed_s is None and back.queue_reqs == 2
    assert Costs.from_wire(()) is None  # an engine that publishes nothing
    assert Costs.from_wire(wire[:2]) == Costs(prefill_s_per_token=1.23e-4, step_s=0.01)
    assert Costs.from_wire((*wire, 7.0)) == back  # a newer engine's extra field ignored
    assert Costs.from_wire((float("inf"),)) is None


def test_predicted_ttft_adds_queue_load_and_prefill() -> None:
    c = Costs(
        prefill_s_per_token=1e-4,
        step_s=0.02,
        local_fixed_s=0.01,
        local_s_per_token=1e-5,
        queue_s=0.3,
        req_s=0.1,
    )
    got = predicted_ttft(c, local_tokens=1000, remote_tokens=0, computed_tokens=500)
    assert got == pytest.approx(0.3 + (0.01 + 0.01) + 0.02 + 0.05)
    more = predicted_ttft(
        c, local_tokens=1000, remote_tokens=0, computed_tokens=500, unreported_reqs=2
    )
    assert more == pytest.approx(got + 0.2)
    assert predicted_ttft(Costs(), local_tokens=0, remote_tokens=0, computed_tokens=10) is None


# ---------------------------------------------------------------- the router's choice
def _router_pick(cands: list, total: int = 100, block_size: int = 16):  # type: ignore[no-untyped-def]
    import random

    from kvray.serving.score import Weights, pick, pick_ttft

    names = [f"r{i}" for i in range(len(cands))]
    old = pick(names, total, cands, Weights(), random.Random(0))[0][0]
    got = pick_ttft(names, total, cands, block_size, random.Random(0))
    assert got is not None
    return old, got[0][0], got[1]


def test_router_time_model_recomputes_where_weights_load() -> None:
    """kv-heavy: a small model's prefill of 1,600 tokens (0.08 s) beats loading its 12 MiB
    from the node's pool (0.2 s). The weights send the prompt to the replica whose node pool
    holds it even behind a request (0.8 - 0.25 = 0.55 > 0); the time model sends it to the
    idle replica, which computes it."""
    from kvray.serving.score import Candidate

    kv_heavy = dict(
        prefill_s_per_token=5e-5, step_s=0.01, local_fixed_s=0.01, local_s_per_token=1.2e-4
    )
    busy = Costs(**kv_heavy, queue_s=0.08, queue_reqs=1, req_s=0.09)
    idle = Costs(**kv_heavy)
    a = Candidate(node_pool=100, anywhere=100, queue=1, costs=busy)
    b = Candidate(queue=0, costs=idle)
    old, new, reason = _router_pick([a, b])
    assert (old, new) == ("r0", "r1")
    assert reason == "balanced"


def test_router_time_model_waits_where_weights_spread() -> None:
    """A replica whose engine holds the whole prompt behind two short requests (0.1 s of
    queue) against one that would load 1,600 tokens from its node's pool (0.3 s): the
    weights prefer the load (0.8 > 1.0 - 0.5); the time model the engine hit."""
    from kvray.serving.score import Candidate

    shape = dict(
        prefill_s_per_token=5e-4, step_s=0.02, local_fixed_s=0.01, local_s_per_token=1.8e-4
    )
    holder = Candidate(
        engine=100,
        node_pool=100,
        anywhere=100,
        queue=2,
        costs=Costs(**shape, queue_s=0.1, queue_reqs=2, req_s=0.05),
    )
    loader = Candidate(node_pool=100, anywhere=100, queue=0, costs=Costs(**shape))
    old, new, reason = _router_pick([holder, loader])
    assert (old, new) == ("r1", "r0")
    assert reason == "engine"


def test_router_counts_requests_sent_since_the_report() -> None:
    """Serve counts 3 requests on a replica whose last report knew none: each costs a mean
    request (0.2 s) in its prediction, so an equal cold replica with an empty queue wins."""
    from kvray.serving.score import Candidate

    shape = dict(prefill_s_per_token=1e-4, step_s=0.01, req_s=0.2)
    a = Candidate(queue=3, costs=Costs(**shape))
    b = Candidate(queue=0, costs=Costs(**shape))
    assert _router_pick([a, b])[1] == "r1"


def test_router_without_estimates_falls_back_and_stands_in() -> None:
    import random

    from kvray.serving.score import Candidate, pick_ttft

    cold = [Candidate(engine=5), Candidate()]
    assert pick_ttft(["a", "b"], 10, cold, 16, random.Random(0)) is None
    # one replica measured: the other is predicted with its estimates and no queue
    warm = Costs(prefill_s_per_token=1e-3, step_s=0.01, queue_s=1.0, queue_reqs=4)
    mixed = [Candidate(queue=4, costs=warm), Candidate(queue=0)]
    got = pick_ttft(["a", "b"], 10, mixed, 16, random.Random(0))
    assert got is not None and got[0][0] == "b"


def test_an_unchanged_report_compares_equal() -> None:
    """The index bumps its version (and wakes routers' feeds) only when a report's figures
    changed: the same estimates must give equal tuples (no NaN on the wire)."""
    c = Costs(prefill_s_per_token=1e-4, step_s=0.01)
    assert c.to_wire() == Costs(prefill_s_per_token=1e-4, step_s=0.01).to_wire()
    assert all(v == v for v in c.to_wire())


def test_decode_steps_price_each_running_request() -> None:
    """Decode-only steps of 1 to 4 requests: each request adds its slope to a step, and a
    replica running more requests is predicted slower for the same prompt."""
    ec = EngineCosts()
    t = 0.0
    for i in range(40):
        d = 1 + i % 4
        ec.observe_step(0, 0.005 + 0.002 * d, t, decode_reqs=d)
        ec.observe_step(512, 0.01 + 512 * 1e-4, t + 0.01, decode_reqs=0)
        t += 0.02
    c = ec.costs(t)
    assert c.decode_s_per_req == pytest.approx(0.002)
    assert c.decode_step_s == pytest.approx(0.007)
    busy = Costs(**{**c.__dict__, "queue_reqs": 4.0})
    kw = dict(local_tokens=0, remote_tokens=0, computed_tokens=256)
    p_idle, p_busy = predicted_ttft(c, **kw), predicted_ttft(busy, **kw)  # type: ignore[arg-type]
    assert p_idle is not None and p_busy == pytest.approx(p_idle + 4 * 0.002)


def test_a_store_is_worth_making_only_where_its_later_load_pays() -> None:
    """Saves priced (issue 32): until the prefill and the local load path are measured every
    store is made; where a local load of the prefix costs more than its recompute, none; a
    long prefix whose load amortises the load's fixed cost is stored while a short one is not;
    once the load samples decay, stores are made again."""
    from kvray.connector.pricing import Pricing

    now = [0.0]
    p = Pricing(32, 1, "pool-a", clock=lambda: now[0])
    assert p.worth_storing(512)  # nothing measured
    for i in range(20):
        p.engine.observe_step(1000 if i % 2 else 0, 0.01 + (1000 if i % 2 else 0) * 1e-4, i * 0.1)
    now[0] = 2.0
    p.costs = p.engine.costs(now[0])
    assert p.warm and p.worth_storing(512)  # the local load path was never measured
    # a local load costs 0.05 s + 5e-5 s a token against 1e-4 s a token to recompute: it pays
    # beyond 1,000 tokens
    for i, n in enumerate((256, 512, 2048, 4096)):
        p.engine.observe_load("local", n, 0.05 + n * 5e-5, 2.0 + i * 0.01)
    p.costs = p.engine.costs(2.1)
    assert not p.worth_storing(512)
    assert p.worth_storing(4096)
    # the engine keeps stepping, no load is tried: the load samples expire, stores resume
    t = 2.1
    while t < 2.1 + 8 * HALF_LIFE_S:
        p.engine.observe_step(1000, 0.11, t)
        p.engine.observe_step(0, 0.01, t + 0.05)
        t += 0.1
    p.costs = p.engine.costs(t)
    assert p.warm and p.costs.load("local") is None
    assert p.worth_storing(512)
