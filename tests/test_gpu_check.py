"""scripts/gpu_check.sh on a machine like the bare CUDA one it is for (no Ray, no vLLM, no
pyarrow: imports of them fail here through a ``sitecustomize`` on PYTHONPATH) with no CUDA
device: it starts, imports the kernels and their tests, skips cleanly and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = '''
import importlib.abc
import sys

BLOCKED = ("ray", "vllm", "pyarrow")


class _Absent(importlib.abc.MetaPathFinder):
    """Makes BLOCKED look uninstalled (as on the bare GPU machine)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, _Absent())
'''


@pytest.mark.slow
def test_gpu_check_skips_cleanly_without_cuda_ray_or_vllm(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(site),
        "CUDA_VISIBLE_DEVICES": "",  # the skip path, even on a GPU machine
        "LOG_DIR": str(tmp_path / "logs"),
    }
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "ray: absent" in out and "vllm: absent" in out and "pyarrow: absent" in out, out
    assert "kvray.kernels imported" in out, out
    assert "CUDA available: False" in out, out
    tests_log = (tmp_path / "logs" / "tests.log").read_text()
    assert " skipped" in tests_log and "failed" not in tests_log and "error" not in tests_log
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu_check: no CUDA device found"), last
