"""Shared test setup. The Ray fixtures (``ray_cluster``, ``kvray_ns``) live in
:mod:`ray_fixtures` and are only loaded when Ray is installed: the kernel tests
(``test_kernels*.py``) also run on a bare CUDA machine with torch and no Ray or vLLM
(``scripts/gpu_check.sh``). Ray's auth mode is set explicitly so the suite behaves the same
with or without ``~/.ray/auth_token``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ["RAY_AUTH_MODE"] = "disabled"
# Ray workers (and vLLM subprocesses) import test helpers by module name, as pytest does.
_TESTS = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_TESTS, os.path.dirname(_TESTS), os.environ.get("PYTHONPATH")) if p
)
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

try:
    import ray  # noqa: F401
except ImportError:  # a bare CUDA machine (scripts/gpu_check.sh): the kernel tests only
    ray_fixtures = None
else:
    import ray_fixtures
    from ray_fixtures import kvray_ns, module_ns, ray_cluster  # noqa: F401 -- fixtures, by name


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Tell the namespace relay how many of the next tests need a fresh namespace in a row
    (``kvray_ns``, or the first ``module_ns`` of a module): theirs start while this test runs.
    A test without ``kvray_ns`` first waits for the stops behind it, then starts the next
    test's namespace unless it is marked ``quiet`` (it counts what the whole cluster does)."""
    relay = ray_fixtures.RELAY if ray_fixtures is not None else None
    if relay is not None:
        items = item.session.items
        i = _index(items, item)
        wanted = 0
        for later in items[i + 1 : i + 1 + relay.AHEAD] if i is not None else []:
            if not _needs_namespace(later):
                break
            wanted += 1
        relay.wanted_ahead = wanted
        if "kvray_ns" not in getattr(item, "fixturenames", ()):
            relay.settle()
            if wanted and item.get_closest_marker("quiet") is None:
                relay.prefetch(1)
    yield


_positions: dict[int, int] = {}
_first_module_ns: set[int] = set()


def _index(items: list[pytest.Item], item: pytest.Item) -> int | None:
    if len(_positions) != len(items):
        _positions.clear()
        _positions.update((id(x), n) for n, x in enumerate(items))
        _first_module_ns.clear()
        seen: set[str] = set()
        for x in items:
            module = x.nodeid.split("::")[0]
            if "module_ns" in getattr(x, "fixturenames", ()) and module not in seen:
                seen.add(module)
                _first_module_ns.add(id(x))
    return _positions.get(id(item))


def _needs_namespace(item: pytest.Item) -> bool:
    """Whether ``item`` takes a namespace from the relay when it starts."""
    return "kvray_ns" in getattr(item, "fixturenames", ()) or id(item) in _first_module_ns
