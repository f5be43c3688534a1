"""Prefill/decode disaggregation on Ray Serve LLM with kvray as the KV transport: one real
P/D app (1 prefill + 1 decode replica, one simulated node each, vLLM on CPU) for the module,
the real ``openai`` client over Serve's HTTP proxy.

The reference ("collocated") tokens come from the prefill deployment itself called as a plain
``LLMServer`` (no ``kv_transfer_params``): the same engine configuration computing the whole
request on one replica."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from ray.cluster_utils import Cluster

pytest.importorskip("vllm")
pytest.importorskip("ray.serve.llm")

from ray_fixtures import free_port
from test_serve import ENGINE_ARGS, MODEL, VOCAB, _token_prompt, _wait_held, _wait_running

import kvray
from kvray.registry import clear_key_spaces
from kvray.testing.engines import BLOCK_SIZE, build_text_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

APP = "kvray-pd-test"
TEXT = "".join(f"row_{i} = fetch({i}, retries=3)\n" for i in range(30))


@pytest.fixture(scope="module")
def pd_app(ray_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from ray import serve

    from kvray.serving import build_app

    model = build_text_model(tmp_path_factory.mktemp("pd") / "model", vocab=VOCAB)
    ns = f"pd{uuid.uuid4().hex[:6]}"
    kvray.start(namespace=ns, capacity="64MiB", health_check_interval_s=0.5)
    port = free_port()
    try:
        app = build_app(
            model,
            pd="1:1",
            namespace=ns,
            served_model_name=MODEL,
            engine_args=ENGINE_ARGS,
            num_cpus=2,
        )
        # One proxy (the head's): the clients call 127.0.0.1; a proxy per simulated node is ~5 CPU-s
        # of startup for nothing.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name=APP, route_prefix="/", blocking=False)
        _wait_running(APP, timeout=600)
        yield ns, f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()
        kvray.stop(ns)
        clear_key_spaces(ns)


def _client(base_url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)


def _collocated(kind: str, **kw: Any) -> Any:
    """The same request computed whole by the prefill deployment (a plain LLMServer)."""
    from ray import serve
    from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest

    handle = serve.get_deployment_handle(f"Prefill:{MODEL}", APP).options(
        stream=True, method_name=kind
    )
    cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
    request = cls(model=MODEL, temperature=0.0, **kw)

    async def run() -> Any:
        return [c async for c in handle.remote(request, None)]

    loop = asyncio.new_event_loop()
    try:
        (out,) = loop.run_until_complete(asyncio.wait_for(run(), 300))
    finally:
        loop.close()
    return out


def test_text_chat_and_stream_equal_the_collocated_tokens(pd_app: Any) -> None:
    _, url = pd_app
    client = _client(url)
    body = {"ignore_eos": True}
    text = client.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=8, temperature=0, extra_body=body
    )
    prompt_tokens = text.usage.prompt_tokens
    assert prompt_tokens > 4 * BLOCK_SIZE
    # The decode engine computed at most one block of the prompt: the rest came from kvray.
    cached = text.usage.prompt_tokens_details.cached_tokens
    assert prompt_tokens - cached <= BLOCK_SIZE, (prompt_tokens, cached)
    ref = _collocated("completions", prompt=TEXT, max_tokens=8, ignore_eos=True)
    assert text.choices[0].text == ref.choices[0].text

    streamed = client.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=8, temperature=0, stream=True, extra_body=body
    )
    assert "".join(c.choices[0].text for c in streamed) == ref.choices[0].text

    messages = [{"role": "user", "content": TEXT + "and then?"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body=body
    )
    ref_chat = _collocated("chat", messages=messages, max_tokens=6, ignore_eos=True)
    assert chat.choices[0].message.content == ref_chat.choices[0].message.content
    chat_cached = chat.usage.prompt_tokens_details.cached_tokens
    assert chat.usage.prompt_tokens - chat_cached <= BLOCK_SIZE


def test_the_handed_off_blocks_stay_in_kvray_for_later_requests(pd_app: Any) -> None:
    """The prefill's blocks are in the cluster cache once handed off: any replica's later
    request with the same prefix finds them there (the index shows every block)."""
    ns, url = pd_app
    client = _client(url)
    prompt = _token_prompt(6 * BLOCK_SIZE + 5, seed=31)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens - out.usage.prompt_tokens_details.cached_tokens <= BLOCK_SIZE
    store = kvray.connect(ns)
    try:
        held = _wait_held(store, ns, prompt, 6)
    finally:
        store.close()
    assert max(held.values()) == 6


def test_a_prefill_replica_killed_mid_request_ends_it_cleanly(pd_app: Any) -> None:
    """The prefill replica dies with a request inside its engine (frozen there first, so the
    kill lands mid-request): the client gets a completed request with the collocated tokens or
    a clear OpenAI error, well within its timeout, never a hang; Serve replaces the replica and
    the app serves the same request right after."""
    import os
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor

    import openai
    import psutil
    import ray

    _, url = pd_app
    (name,) = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{APP}#Prefill")
    ]
    replica = ray.get_actor(name, namespace="serve")
    pid = ray.get(replica.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    engine = [c.pid for c in psutil.Process(pid).children(recursive=True)]
    assert engine, "the prefill replica runs no engine process"
    prompt = _token_prompt(5 * BLOCK_SIZE + 3, seed=41)
    client = _client(url)  # 120 s timeout: a hang shows as APITimeoutError
    outcome: Any
    for p in engine:
        os.kill(p, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            t0 = time.monotonic()
            sent = pool.submit(
                client.completions.create, model=MODEL, prompt=prompt, max_tokens=4, temperature=0
            )
            time.sleep(2.0)  # the request reaches the frozen engine
            assert not sent.done(), "the request finished while the prefill engine was frozen"
            ray.kill(replica, no_restart=True)
            try:
                outcome = sent.result(timeout=150)
            except openai.APITimeoutError:
                pytest.fail("the request hung after its prefill replica died")
            except openai.APIStatusError as e:
                outcome = e
            elapsed = time.monotonic() - t0
    finally:
        for p in engine:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    _wait_running(APP, timeout=600)
    ref = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    if isinstance(outcome, openai.APIStatusError):
        assert outcome.status_code >= 500 and str(outcome), outcome
    else:
        assert outcome.choices[0].text == ref.choices[0].text
    assert elapsed < 100, elapsed
    print("killed prefill:", type(outcome).__name__, f"{elapsed:.1f} s", str(outcome)[:200])


def test_backend_keeps_client_params_from_the_prefill(ray_cluster: Cluster) -> None:
    """A client's own kv_transfer_params are replaced (Ray's default asserts on them), and a
    prefill response without kvray's handoff gives the decode no params at all."""
    from ray.serve.llm.openai_api_models import CompletionRequest

    from kvray.serving.app import build_llm_config
    from kvray.serving.backend import HANDOFF_KEY, KVRayConnectorBackend

    backend = KVRayConnectorBackend(build_llm_config("/models/m", router="pow2"))
    req = CompletionRequest(model="m", prompt="hi", max_tokens=9, stream=True)
    req.kv_transfer_params = {HANDOFF_KEY: {"n": 1}}
    pre = backend.prepare_prefill_request(request=req, peer=None)
    assert pre.kv_transfer_params["do_remote_decode"] is True
    assert HANDOFF_KEY not in pre.kv_transfer_params
    assert pre.max_tokens == 1 and pre.stream is False

    class Resp:
        kv_transfer_params: Any = {"do_remote_decode": False}

    assert backend.prepare_decode_request(request=req, peer=None, prefill_response=Resp())
    dec = backend.prepare_decode_request(request=req, peer=None, prefill_response=Resp())
    assert dec.kv_transfer_params is None and dec.max_tokens == 9
    Resp.kv_transfer_params = {HANDOFF_KEY: {"v": 1}}
    dec = backend.prepare_decode_request(request=req, peer=None, prefill_response=Resp())
    assert dec.kv_transfer_params == {HANDOFF_KEY: {"v": 1}}


def test_handoff_key_is_the_connectors() -> None:
    from kvray.connector.handoff import HANDOFF_KEY as CONNECTOR_KEY
    from kvray.serving.backend import HANDOFF_KEY

    assert HANDOFF_KEY == CONNECTOR_KEY
