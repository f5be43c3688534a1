"""The connector loads only what pays (issue 32): vLLM's real ``Scheduler`` with kvray's
connector (the harness of ``test_connector_scheduler``), real Ray.

A pool made slow (the worker's reads wait 1.5 s) is measured by the connector's own load
figures; the next hit from it is left to vLLM to compute: 0 external tokens, no load job,
counted, and the KV vLLM computes is the one a load would have written.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("vllm")

import test_connector_scheduler as tcs

from kvray.testing.engines import BLOCK_SIZE

pytestmark = [pytest.mark.vllm]

SLOW_S = 1.5

# The harness's fixtures (a tiny model, a Scheduler with both connector roles).
model_dir = tcs.model_dir
harness_factory = tcs.harness_factory
prompt = tcs.prompt


def _warm_up(h: Any) -> None:
    """Prompts computed and stored: the engine's step costs are measured (no hit needed)."""
    for seed in (101, 102):
        h.add(prompt(6 * BLOCK_SIZE + 3, seed=seed))
        h.add(prompt(2 * BLOCK_SIZE + 1, seed=seed + 10))
        h.run()
    h.sconn.pricing.refresh_soon()
    h.step()  # an empty step refreshes the estimates
    assert h.sconn.pricing.warm, "the engine's prefill was not measured"


def _kv_of(h: Any, req_id: str) -> list[int]:
    return list(h.scheduler.kv_cache_manager.get_block_ids(req_id)[0])


def test_a_slow_pool_is_measured_and_its_hit_recomputed(
    harness_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = harness_factory(load_mode="sync", load_timeout_s=10.0, price_loads=True)  # completes
    sc = h.sconn
    p = prompt(6 * BLOCK_SIZE + 4, seed=7)
    h.add(p)
    h.settle()
    _warm_up(h)
    assert sc.pricing.costs.load("local") is None and sc.pricing.costs.load("remote") is None

    # 1. The pool turns slow. The load path was never measured: the hit is loaded (as before
    #    any estimate), and its seconds are measured.
    store = h.worker.worker.handler.store
    fetch = store.fetch_from

    def slow_fetch(*args: Any, **kwargs: Any) -> Any:
        time.sleep(SLOW_S)
        return fetch(*args, **kwargs)

    monkeypatch.setattr(store, "fetch_from", slow_fetch)
    first = h.add(p)
    so = h.step()
    assert len(so.kv_connector_metadata.loads) == 1
    h.run()
    assert sc.pricing.loads == 1
    sc.pricing.refresh_soon()
    h.step()
    line = sc.pricing.costs.load("local") or sc.pricing.costs.load("remote")
    assert line is not None and line.seconds(6 * BLOCK_SIZE) >= SLOW_S / 2
    h.settle()

    # 2. The same prompt again: recomputed, no load issued, counted.
    declined, tokens = sc.pricing.loads_declined, sc.pricing.tokens_declined
    hits, loaded = sc.hit_tokens, sc.counters.loaded_blocks
    second = h.add(p)
    so = h.step()
    assert not so.kv_connector_metadata.loads, sc.pricing.costs
    assert so.num_scheduled_tokens[second.request_id] == len(p)  # computes the whole prompt
    blocks = _kv_of(h, second.request_id)
    # the KV vLLM computed is what the load of step 1 wrote: same values, block for block
    for i in range(6):
        assert h.block_matches(blocks[i], p[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], i * BLOCK_SIZE)
    h.run()
    assert sc.pricing.loads_declined == declined + 1
    assert sc.pricing.tokens_declined == tokens + 6 * BLOCK_SIZE
    assert sc.hit_tokens == hits and sc.counters.loaded_blocks == loaded
    assert list(first.output_token_ids) == list(second.output_token_ids)


def test_a_prefix_that_would_not_pay_to_load_is_not_stored(
    harness_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saves priced: once this engine measured its local loads slower than recomputing, a new
    prompt's blocks are not stored (no store job, kvray holds none of them, counted once);
    once the estimates decay, the next prompt's blocks are stored again."""
    h = harness_factory(load_mode="sync", price_loads=True)
    sc = h.sconn
    _warm_up(h)
    stored_before = sc.counters.stored_blocks
    assert stored_before > 0  # cold: the warm-up prompts were stored
    now = time.monotonic()
    for i in range(4):  # what a slow pool measured: ~1 s a load of any size
        sc.pricing.engine.observe_load("local", (2 + i) * BLOCK_SIZE, 1.0, now)
    sc.pricing.refresh_soon()
    h.step()
    assert sc.pricing.costs.load("local") is not None
    assert not sc.pricing.worth_storing(6 * BLOCK_SIZE)

    def stores_of(p: list[int]) -> tuple[Any, list[Any]]:
        req = h.add(p, max_tokens=2 * BLOCK_SIZE)  # decodes fill blocks too
        specs = []
        while h.scheduler.has_requests():
            specs += h.step().kv_connector_metadata.stores.values()
        h.settle()
        return req, [s for s in specs if s.req_id == req.request_id]

    req, specs = stores_of(prompt(6 * BLOCK_SIZE + 5, seed=31))
    assert specs == [] and sc.counters.stored_blocks == stored_before
    assert sc._find_hit([bytes(x) for x in req.block_hashes])[0] == 0
    assert sc.pricing.saves_declined == 1

    # the engine's estimates age out (an hour later): stores are made again
    later = now + 3600.0
    monkeypatch.setattr(sc.pricing, "clock", lambda: later)
    sc.pricing.refresh_soon()
    h.step()
    assert sc.pricing.worth_storing(6 * BLOCK_SIZE)
    req, specs = stores_of(prompt(6 * BLOCK_SIZE + 5, seed=32))
    assert specs and sc._find_hit([bytes(x) for x in req.block_hashes])[0] >= 6
    assert sc.pricing.saves_declined == 1


def test_cold_start_loads_every_hit(harness_factory: Any) -> None:
    """No estimate yet: today's behaviour exactly (the hit is loaded, nothing declined)."""
    h = harness_factory(load_mode="sync", price_loads=True)
    p = prompt(3 * BLOCK_SIZE + 4, seed=8)
    h.add(p)
    h.settle()
    sc = h.sconn
    sc.pricing.engine.step = type(sc.pricing.engine.step)()  # forget what was measured
    sc.pricing.refresh_soon()
    h.step()
    assert not sc.pricing.warm and sc.pricing.published == ()
    h.add(p)
    so = h.step()
    (load,) = so.kv_connector_metadata.loads.values()
    assert len(load.block_ids) == 3
    h.run()
    assert sc.pricing.loads_declined == 0


def test_engine_tokens_identical_when_a_slow_pool_is_recomputed(
    kvray_ns: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real in-process vLLM engine: the prompts' KV is stored, the pool turns slow, one
    load measures it, and the next run computes the prompts instead (nothing from kvray,
    counted); the token ids are the same as without kvray every time."""
    from vllm import LLM

    from kvray.testing.engines import (
        build_tiny_llama,
        cached_tokens,
        close_llm,
        connector_of,
        engine_kwargs,
        finish_delayed_frees,
        generate,
        in_process_engines,
        kvray_transfer_config,
        make_prompts,
        token_ids,
        worker_connector_of,
    )

    model = build_tiny_llama(tmp_path_factory.mktemp("costs-llama"))
    prompts = make_prompts(2, 200, 30, seed=9)
    with in_process_engines():
        plain = LLM(**engine_kwargs(model))
        try:
            want = token_ids(generate(plain, prompts))
        finally:
            close_llm(plain)
        ktc = kvray_transfer_config(kvray_ns, load_timeout_s=10.0, price_loads=True)
        llm = LLM(**engine_kwargs(model, kv_transfer_config=ktc))
        try:
            sched = connector_of(llm).scheduler
            worker = worker_connector_of(llm).worker

            def settle() -> None:
                finish_delayed_frees(llm)
                worker.flush()
                connector_of(llm).store.sync()
                assert llm.reset_prefix_cache()

            assert token_ids(generate(llm, prompts)) == want  # computed and stored
            settle()
            # the engine's steps were measured (published at its next refresh, in a step)
            assert sched.pricing.engine.step.fit(time.monotonic()) is not None
            store = worker.handler.store
            fetch = store.fetch_from

            def slow_fetch(*args: Any, **kwargs: Any) -> Any:
                time.sleep(SLOW_S)
                return fetch(*args, **kwargs)

            monkeypatch.setattr(store, "fetch_from", slow_fetch)
            loaded = generate(llm, prompts[:1])  # never measured: loaded, slowly
            assert token_ids(loaded) == want[:1] and cached_tokens(loaded)[0] > 0
            assert sched.pricing.loads >= 1
            settle()
            declined = sched.pricing.loads_declined
            again = generate(llm, prompts)
            assert token_ids(again) == want
            # the first prompt's prefix came from nowhere (vLLM's cache was reset, kvray
            # declined); the second may share it from vLLM's own cache in the same batch
            assert cached_tokens(again)[0] == 0
            assert sched.pricing.loads_declined > declined
        finally:
            close_llm(llm)


def test_store_seen_only_stores_a_prefix_at_its_second_computation(harness_factory: Any) -> None:
    """``store_seen_only``: a prompt computed for the first time is not stored (its blocks
    are counted as skipped); computed again (vLLM's cache emptied), it is stored; the third
    time it is loaded, byte for byte what vLLM computes. A prompt sharing its head stores
    nothing new of its own tail."""
    h = harness_factory(load_mode="sync", store_seen_only=True)
    sc = h.sconn
    p = prompt(6 * BLOCK_SIZE + 4, seed=21)
    first = h.add(p)
    h.settle()
    hashes = list(first.block_hashes)
    assert sc._find_hit(hashes)[0] == 0, "stored at its first sighting"
    assert sc.sightings.skipped_blocks == 6

    second = h.add(p)  # vLLM's cache was emptied: computed again, now stored
    so = h.step()
    assert not so.kv_connector_metadata.loads
    h.settle()
    assert sc._find_hit(list(second.block_hashes))[0] == 6

    third = h.add(p)
    so = h.step()
    (load,) = so.kv_connector_metadata.loads.values()
    assert len(load.block_ids) == 6
    h.run()
    for i, block in enumerate(load.block_ids):  # what vLLM would have computed there
        assert h.block_matches(block, p[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], i * BLOCK_SIZE)
    h.settle()
    assert third.num_computed_tokens >= len(p)

    # A prompt sharing the first 3 blocks: its own tail is seen for the first time.
    skipped = sc.sightings.skipped_blocks
    q = p[: 3 * BLOCK_SIZE] + prompt(3 * BLOCK_SIZE + 4, seed=22)
    other = h.add(q)
    h.settle()
    assert sc._find_hit(list(other.block_hashes))[0] == 3
    assert sc.sightings.skipped_blocks == skipped + 3
    tcs.assert_scheduler_empty(h)


def test_sightings_are_bounded_and_count_only_earlier_prompts() -> None:
    """Two generations of at most ``limit`` hashes: a prompt is sighted against earlier ones
    only (its own blocks do not count), and what was seen two generations ago is forgotten."""
    from kvray.connector.sightings import Sightings

    s = Sightings(limit=8)
    a = [b"a0", b"a1", b"a2"]
    assert s.sight(a) == 0  # first time: nothing earlier
    assert s.sight(a) == 3
    assert s.sight([b"a0", b"a1", b"x"]) == 2  # the head only
    for i in range(40):  # other prompts fill two generations
        s.sight([f"o{i}".encode()])
        assert len(s) <= 2 * 8
    assert s.sight(a) == 0  # forgotten: stored again only at its next sighting


def test_sightings_measure_how_much_of_what_is_first_seen_is_needed_again() -> None:
    """``reuse``: of the blocks prompts held for the first time, the share a later prompt
    needed again beyond vLLM's own cache, each block counted once, from a prior of
    ``prior_blocks`` that all came back; older evidence halves every ``half_blocks``."""
    from kvray.connector.sightings import Sightings

    a = [b"a0", b"a1", b"a2", b"a3"]
    b = [b"b0", b"b1", b"b2", b"b3"]
    p = Sightings(prior_blocks=4)
    assert p.reuse == 1.0  # nothing measured: taken as coming back (stores are made)
    p.sight(a)
    assert p.reuse == 4 / 8  # 4 first sightings, none back yet, against the prior
    p.sight(b)
    assert p.reuse == 4 / 12

    s = Sightings(prior_blocks=0, half_blocks=1000)
    assert s.reuse is None
    assert s.sight(a) == 0 and s.reuse == 0.0
    assert s.sight(b) == 0 and s.reuse == 0.0  # 8, none needed again
    assert s.sight(a, local_blocks=4) == 4 and s.reuse == 0.0  # vLLM's cache held all of a
    assert s.sight(a, local_blocks=1) == 4 and s.reuse == 3 / 8  # a1-a3 beyond it
    assert s.sight(a) == 4 and s.reuse == 4 / 8  # now a0 too
    assert s.sight(a) == 4 and s.reuse == 4 / 8  # each block counted once
    assert s.sight([*a[:2], b"c2", b"c3"]) == 2 and s.reuse == 4 / 10  # a new tail
    assert (s.first_blocks, s.returned_blocks) == (10, 4)

    d = Sightings(prior_blocks=0, half_blocks=4)  # old evidence fades
    d.sight(a)
    d.sight(a)  # all 4 came back
    assert d.reuse == 1.0
    for i in range(6):  # one-off prompts: the share falls towards 0
        d.sight([f"o{i}{j}".encode() for j in range(4)])
    assert d.reuse is not None and d.reuse < 0.1


def test_sightings_price_each_kind_of_prompt_on_its_own_evidence() -> None:
    """Prompts over a few shared documents, each with a one-off question after it (vLLM's
    ``prefix_repetition``): a document first seen in a prompt sharing nothing earlier comes
    back (beyond vLLM's cache), a question first seen after a known document never does. One
    ratio over both says half come back; per kind, the documents' reads 1 and the
    questions' falls towards 0, so a continuing prompt's new blocks stop being stored."""
    from kvray.connector.sightings import Sightings

    s = Sightings(prior_blocks=4, half_blocks=10_000)
    docs = [[f"d{d}/{i}".encode() for i in range(8)] for d in range(2)]
    for r in range(12):
        doc = docs[r % 2]
        question = [f"q{r}/{i}".encode() for i in range(8)]
        s.sight(doc + question, local_blocks=0)  # vLLM's cache holds none of it
    fresh, continued = s.reuse_of(continued=False), s.reuse_of(continued=True)
    assert fresh is not None and continued is not None
    # Fresh: 2 prompts, 32 first sightings (16 documents' blocks, 16 questions'), the 16
    # documents' blocks back, plus the prior; continued: 10 questions of 8, none back.
    assert fresh == (16 + 4) / (32 + 4)
    assert continued == 4 / (80 + 4)
    assert s.reuse == (16 + 4) / (112 + 4)  # one ratio over both kinds, as before
    # A conversation: each turn continues the last and its new blocks come back next turn.
    c = Sightings(prior_blocks=4, half_blocks=10_000)
    turn: list[bytes] = []
    for t in range(10):
        turn = turn + [f"t{t}/{i}".encode() for i in range(4)]
        c.sight(turn, local_blocks=0)
    # 9 continuing turns of 4 new blocks; all back but the last turn's (no turn after it).
    assert c.reuse_of(continued=True) == (32 + 4) / (36 + 4)
    assert c.reuse_of(continued=False) == (4 + 4) / (4 + 4)  # the first turn's, back


def test_auto_doorkeeper_stores_first_sightings_only_while_they_pay(harness_factory: Any) -> None:
    """``store_seen_only="auto"``: stored as before while nothing is measured; once this
    engine's prefill and local loads are measured and few first sightings come back, a new
    prompt's blocks are not stored (counted) and its second computation stores them; once
    most first sightings come back, a new prompt is stored at its first computation again."""
    h = harness_factory(load_mode="sync", store_seen_only="auto")
    sc = h.sconn
    sc.sightings.prior_blocks = 0  # (the prior is tested above)
    _warm_up(h)  # cold: the warm-up prompts are stored at their first sighting
    assert sc.counters.stored_blocks > 0 and sc.sightings.skipped_blocks == 0
    assert sc.sightings.reuse == 0.0
    per = sc.pricing.costs.prefill_s_per_token
    assert per is not None
    assert sc.pricing.store_s_per_token.value(time.monotonic()) is not None  # puts timed
    now = time.monotonic()
    for i in range(4):  # this node's pool, measured: a load costs a quarter of a recompute
        tokens = (2 + i) * BLOCK_SIZE
        sc.pricing.engine.observe_load("local", tokens, 0.25 * per * tokens, now, n=1000)
    sc.pricing.stores_done(0.25 * per * 1000 * BLOCK_SIZE, 1000)  # and so does a store
    sc.pricing.refresh_soon()
    h.step()
    assert sc.pricing.costs.load("local") is not None

    def computed(p: list[int]) -> int:
        """Computes ``p`` (vLLM's cache emptied after): the blocks kvray then holds."""
        req = h.add(p)
        h.run()
        h.settle()
        return sc._find_hit([bytes(x) for x in req.block_hashes])[0]

    p = prompt(6 * BLOCK_SIZE + 4, seed=41)
    stored = sc.counters.stored_blocks
    assert computed(p) == 0  # nothing first seen comes back: not stored
    assert sc.sightings.skipped_blocks == 6 and sc.counters.stored_blocks == stored
    assert computed(p) == 6  # computed again: stored, as ``store_seen_only`` does

    sc.sightings.half_blocks = 6  # the evidence of the next prompts weighs most
    for seed in (42, 43, 44):  # prompts that come back beyond vLLM's cache
        q = prompt(6 * BLOCK_SIZE + 4, seed=seed)
        computed(q)
        assert computed(q) == 6
    reuse = sc.sightings.reuse
    assert reuse is not None and reuse > 0.5, reuse
    skipped = sc.sightings.skipped_blocks
    assert computed(prompt(6 * BLOCK_SIZE + 4, seed=45)) == 6  # stored at its first sighting
    assert sc.sightings.skipped_blocks == skipped
    tcs.assert_scheduler_empty(h)


def test_a_store_is_priced_by_what_it_takes_from_the_engine_not_by_its_pools_answer(
    harness_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store's price (``store_seen_only="auto"``'s ``S``) is what the engine's process
    spends on it: the gather and hand-off on the engine thread and the put threads' CPU. A
    pool that answers 1.5 s late makes the store no dearer: no request waits for a store."""
    import threading
    from concurrent.futures import Future

    h = harness_factory(load_mode="sync", store_seen_only="auto")
    sc = h.sconn
    store = h.worker.worker.handler.store
    put_shard = store.put_shard

    def late_put_shard(*args: Any, **kwargs: Any) -> Any:
        inner = put_shard(*args, **kwargs)
        outer: Future[Any] = Future()

        def answer() -> None:
            try:
                outer.set_result(inner.result())
            except Exception as e:  # pragma: no cover - the real put failed
                outer.set_exception(e)

        threading.Timer(SLOW_S, answer).start()
        return outer

    monkeypatch.setattr(store, "put_shard", late_put_shard)
    p = prompt(6 * BLOCK_SIZE + 4, seed=51)
    t0 = time.monotonic()
    h.add(p)
    h.settle()
    assert time.monotonic() - t0 >= SLOW_S  # the store job waited for the late answer
    h.step()  # its counters reach the scheduler side
    assert sc.counters.stored_blocks >= 6
    per = sc.pricing.store_s_per_token.value(time.monotonic())
    assert per is not None and per > 0.0  # measured
    # the whole prompt's store priced at well under the wait for its pool's answer
    assert per * 6 * BLOCK_SIZE < SLOW_S / 4, per
