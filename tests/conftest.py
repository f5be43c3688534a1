"""Shared test setup. The Ray fixtures (``ray_cluster``, ``kvray_ns``) live in
:mod:`ray_fixtures` and are only loaded when Ray is installed: the kernel tests
(``test_kernels*.py``) also run on a bare CUDA machine with torch and no Ray or vLLM
(``scripts/gpu_check.sh``). Ray's auth mode is set explicitly so the suite behaves the same
with or without ``~/.ray/auth_token``.
"""

from __future__ import annotations

import os

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
    pass
else:
    from ray_fixtures import kvray_ns, ray_cluster  # noqa: F401 -- fixtures, by name
