"""The README's main job, ``kvray demo``, end to end in its own process (small sizes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_demo_loads_round_two_prefixes_from_kvray() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"RAY_AUTH_MODE": "disabled", "COLUMNS": "200", "TERM": "dumb"})
    kvray_bin = Path(sys.executable).with_name("kvray")
    out = subprocess.run(
        [str(kvray_bin), "demo", "--model-mb", "20", "--prompt-tokens", "256", "--prompts", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # Both prompts' 256-token prefixes (8 blocks each) came from kvray, not recompute.
    loaded = re.search(r"tokens loaded from kvray \(round 2\)\W+([\d,]+) of ([\d,]+)", out.stdout)
    assert loaded is not None, out.stdout
    assert int(loaded.group(1).replace(",", "")) == 2 * 256
    assert "100% of 16 blocks" in out.stdout
    assert "Ray dashboard" in out.stdout
