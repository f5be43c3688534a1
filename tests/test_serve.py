"""``kvray serve`` on simulated nodes: a request served on node B hits blocks stored by node A."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

pytest.importorskip("vllm")

from vllm_helpers import BLOCK_SIZE, build_tiny_llama, engine_kwargs, make_prompts

from kvray.config import KVRayConfig
from kvray.serve import ServeHandle, make_app, start_serving

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _node_with(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


@pytest.fixture(scope="module")
def serving(
    ray_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServeHandle, str, str]]:
    import uuid

    import kvray

    model = build_tiny_llama(tmp_path_factory.mktemp("serve") / "model")
    ns = f"serve{uuid.uuid4().hex[:6]}"
    args = engine_kwargs(model)
    args.pop("model")
    node_a, node_b = _node_with("node_a"), _node_with("node_b")
    handle = start_serving(
        model,
        config=KVRayConfig(namespace=ns, capacity="64MiB"),
        engine_args=args,
        node_ids=[node_a, node_b],
    )
    try:
        yield handle, node_a, node_b
    finally:
        handle.shutdown()
        kvray.stop(ns)


def _wait_cached(handle: ServeHandle, tokens: list[int], node: str, blocks: int) -> None:
    deadline = time.monotonic() + 30
    while handle.cached_blocks(tokens)[node] < blocks:
        assert time.monotonic() < deadline, f"node never held {blocks} blocks of the prompt"
        time.sleep(0.1)


def test_request_on_node_b_loads_blocks_stored_by_node_a(
    serving: tuple[ServeHandle, str, str],
) -> None:
    handle, node_a, node_b = serving
    p1, p2, p3 = make_prompts(3, prefix_len=6 * BLOCK_SIZE, suffix_len=20, seed=11)
    sampling = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    first = handle.generate(p1, sampling, node_id=node_a)
    assert first["node_id"] == node_a
    assert first["num_cached_tokens"] == 0
    _wait_cached(handle, p2, node_a, 6)
    assert handle.cached_blocks(p2)[node_b] == 0
    # Node B has never seen the prefix: it loads it from node A's pool.
    on_b = handle.generate(p2, sampling, node_id=node_b)
    assert on_b["node_id"] == node_b
    assert on_b["num_cached_tokens"] >= 6 * BLOCK_SIZE
    # Same request on node A (vLLM's own prefix cache there): identical tokens.
    on_a = handle.generate(p2, sampling, node_id=node_a)
    assert on_a["token_ids"] == on_b["token_ids"]
    # Without a forced node the router sends the shared prefix to a holder of its blocks.
    routed = handle.generate(p3, sampling)
    assert routed["node_id"] == handle.route(p3)
    assert routed["node_id"] in (node_a, node_b)
    assert routed["num_cached_tokens"] >= 6 * BLOCK_SIZE


def test_router_prefers_the_node_holding_the_prefix(serving: tuple[ServeHandle, str, str]) -> None:
    handle, node_a, node_b = serving
    (p1, p2) = make_prompts(2, prefix_len=4 * BLOCK_SIZE, suffix_len=10, seed=23)
    handle.generate(p1, {"max_tokens": 2}, node_id=node_b)
    _wait_cached(handle, p2, node_b, 4)
    assert handle.cached_blocks(p2) == {node_a: 0, node_b: 4}
    assert handle.route(p2) == node_b


def test_openai_style_http_endpoint(serving: tuple[ServeHandle, str, str]) -> None:
    from aiohttp import web

    handle, _, _ = serving
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(handle))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        (prompt,) = make_prompts(1, prefix_len=2 * BLOCK_SIZE, suffix_len=3, seed=31)
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 3, "temperature": 0.0}
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            out = json.loads(resp.read())
        assert out["object"] == "text_completion"
        assert len(out["choices"][0]["token_ids"]) == 3
        assert out["usage"]["prompt_tokens"] == len(prompt)
        bad = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps({"prompt": "text"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(bad, timeout=30)
        assert info.value.code == 400
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
            assert Path(json.loads(resp.read())["data"][0]["id"]).name == "model"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.run_until_complete(runner.cleanup())
        loop.close()
