"""``kvray serve`` answers where it says (issue 33, item 4).

Before: on a cluster where Ray Serve already ran (a first ``kvray serve --port A`` stopped with
Ctrl-C left Serve's proxy up), a second ``kvray serve --port B`` deployed, Serve logged "New
http_options ... will not be applied", the app answered on A, and kvray printed B: the user's
client timed out. Now :mod:`kvray.serving.ingress` (what ``kvray serve`` runs its app in)
restarts an idle Serve where asked, reuses one that listens there, refuses in one line when a
Serve with other applications listens elsewhere, and stops the Serve it started on exit.

Real Ray Serve on the session's cluster and a real ``openai`` client on the URL kvray prints;
the app is a small Serve deployment answering ``/v1/models`` (the URL decision does not depend
on what the app serves, and a vLLM app takes minutes to start here).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

pytest.importorskip("ray.serve")
pytest.importorskip("openai")

from ray_fixtures import free_port

from kvray.errors import KVRayError

pytestmark = [pytest.mark.slow]  # Ray Serve started and stopped three times

APP = "kvray-portcheck"
OTHER = "someone-else"
MODEL = "tiny-port"


def _models_app(model: str) -> Any:
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Models:
        async def __call__(self, request: Any) -> dict[str, Any]:
            return {
                "object": "list",
                "data": [{"id": model, "object": "model", "created": 0, "owned_by": "kvray"}],
            }

    return Models.bind()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_closed(port: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while _listening(port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _model_ids(url: str) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", timeout=20, max_retries=0)
    return [m.id for m in client.models.list().data]


@pytest.fixture
def no_serve(ray_cluster: Any) -> Iterator[None]:
    """No Serve before the test, none after it (whatever the test left)."""
    from kvray.serving.ingress import stop_serve

    stop_serve()
    try:
        yield
    finally:
        stop_serve()


def test_serve_stops_the_serve_it_started_on_exit(no_serve: None) -> None:
    from kvray.serving.ingress import running_http, serving

    port = free_port()
    with serving(_models_app(MODEL), APP, "127.0.0.1", port) as ingress:  # `kvray serve`
        assert ingress.url == f"http://127.0.0.1:{port}/v1"
        assert _model_ids(ingress.url) == [MODEL]
    # Ctrl-C: the app and the Serve it started are gone; nothing is left listening.
    assert running_http() is None, "the Serve that kvray serve started outlived it"
    assert _wait_closed(port), f"something still listens on {port}"


def test_a_second_serve_on_another_port_answers_where_it_prints(no_serve: None) -> None:
    from ray import serve

    from kvray.serving.ingress import running_http, serving

    first, second = free_port(), free_port()
    # A proxy left up with no application (what the first `kvray serve` left before).
    serve.start(http_options={"host": "127.0.0.1", "port": first})
    with serving(_models_app(MODEL), APP, "127.0.0.1", second) as ingress:
        assert ingress.url == f"http://127.0.0.1:{second}/v1"
        assert _model_ids(ingress.url) == [MODEL]  # the printed URL answers
        assert str(first) in ingress.note
    assert running_http() is None
    assert _wait_closed(second)


def test_a_serve_with_other_apps_is_refused_in_one_line_or_reused(no_serve: None) -> None:
    """Refused in one line by the API and by ``kvray serve`` (which then starts no kvray
    either), or reused where it listens."""
    import uuid

    from ray import serve
    from typer.testing import CliRunner

    import kvray
    from kvray.ops.cli import app
    from kvray.serving.ingress import running_http, serving

    port, other_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(_models_app("other"), name=OTHER, route_prefix="/other")
    with (
        pytest.raises(KVRayError) as err,
        serving(_models_app(MODEL), APP, "127.0.0.1", other_port),
    ):
        pytest.fail("deployed behind a proxy that does not listen where asked")
    message = str(err.value)
    assert "\n" not in message and f"127.0.0.1:{port}" in message and OTHER in message
    assert APP not in serve.status().applications
    assert running_http() == ("127.0.0.1", port)  # the other app's Serve is left alone

    # The same through the CLI: one `error:` line naming where Serve listens; no kvray started.
    ns = f"port{uuid.uuid4().hex[:6]}"
    try:
        res = CliRunner().invoke(
            app, ["serve", "/models/m", "--namespace", ns, "--port", str(other_port)]
        )
        with pytest.raises(kvray.NotStartedError):
            kvray.connect(ns)
    finally:
        kvray.stop(ns)
    assert res.exit_code == 1, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0], res.output
    assert "kvray serve:" in errors[0] and f"--port {port}" in errors[0]
    assert "Traceback" not in res.output

    # No --port: the running proxy's; Serve (not started by kvray) stays up for the other app.
    with serving(_models_app(MODEL), APP, "127.0.0.1", None) as ingress:
        assert ingress.url == f"http://127.0.0.1:{port}/v1" and not ingress.started
        assert _model_ids(ingress.url) == [MODEL]
    assert running_http() == ("127.0.0.1", port)
    assert set(serve.status().applications) == {OTHER}
    assert ray.is_initialized()
