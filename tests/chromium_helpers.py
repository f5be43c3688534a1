"""Headless Chromium for tests: open a page, wait until its text says something, type into a
field, save a screenshot.

Driven over the DevTools protocol with aiohttp's websocket client (aiohttp ships with
``ray[default]``: no browser-automation package needed). The flags are those that work in a
container as root without a display or network.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
START_TIMEOUT_S = 30.0


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


# JS: focus the input whose <label> reads exactly LABEL (MUI text fields); true if found.
_FOCUS_BY_LABEL = """(() => {
  const label = [...document.querySelectorAll('label')]
    .find(l => l.textContent.trim() === %s);
  if (!label) return false;
  const input = document.getElementById(label.htmlFor)
    || label.parentElement.querySelector('input');
  if (!input) return false;
  input.focus();
  return document.activeElement === input;
})()"""


class Browser:
    """One headless Chromium process (a context manager) with a single page."""

    def __init__(self, binary: str, profile_dir: Path, width: int = 1600, height: int = 1000):
        self.binary = binary
        self.profile_dir = profile_dir
        self.width = width
        self.height = height
        self._proc: subprocess.Popen[bytes] | None = None
        self._ws_url = ""
        self._ids = itertools.count(1)

    def __enter__(self) -> Browser:
        self.profile_dir.mkdir(parents=True, exist_ok=True)  # a new, empty profile
        log = open(self.profile_dir.parent / f"{self.profile_dir.name}.log", "wb")
        self._proc = subprocess.Popen(
            [
                self.binary,
                *FLAGS,
                f"--user-data-dir={self.profile_dir}",
                "--remote-debugging-port=0",
                f"--window-size={self.width},{self.height}",
                "about:blank",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its zygote and renderers go with it in __exit__
        )
        log.close()
        try:
            port = self._devtools_port()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                targets = json.load(r)
            self._ws_url = next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"]
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def _devtools_port(self) -> int:
        """Chromium writes its DevTools port into the profile once it listens."""
        path = self.profile_dir / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self._proc.returncode} at start")
            with contextlib.suppress(OSError, ValueError, IndexError):
                return int(path.read_text().splitlines()[0])
            time.sleep(0.1)
        raise TimeoutError(f"chromium wrote no {path} within {START_TIMEOUT_S:.0f}s")

    def capture(
        self,
        url: str,
        png: Path,
        until: Callable[[str], bool],
        *,
        fill: tuple[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> str:
        """Open ``url``; optionally type ``fill[1]`` into the field labelled ``fill[0]`` once it
        exists; wait until ``until(page text)``; save a screenshot to ``png`` (also when the
        wait fails, to look at) and return the page text (``document.body.innerText``)."""
        return asyncio.run(self._capture(url, png, until, fill, timeout_s))

    async def _capture(
        self,
        url: str,
        png: Path,
        until: Callable[[str], bool],
        fill: tuple[str, str] | None,
        timeout_s: float,
    ) -> str:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(self._ws_url, max_msg_size=0) as ws,
        ):

            async def call(method: str, **params: Any) -> dict[str, Any]:
                msg_id = next(self._ids)
                await ws.send_json({"id": msg_id, "method": method, "params": params})
                while True:  # events arrive in between; skip them
                    msg = await asyncio.wait_for(ws.receive_json(), timeout=30)
                    if msg.get("id") == msg_id:
                        if "error" in msg:
                            raise RuntimeError(f"{method}: {msg['error']}")
                        return msg["result"]

            async def text() -> str:
                expr = "document.body ? document.body.innerText : ''"
                res = await call("Runtime.evaluate", expression=expr, returnByValue=True)
                return str(res["result"].get("value", ""))

            await call(
                "Emulation.setDeviceMetricsOverride",
                width=self.width,
                height=self.height,
                deviceScaleFactor=1,
                mobile=False,
            )
            await call("Page.navigate", url=url)
            deadline = time.monotonic() + timeout_s
            pending_fill = fill
            page = ""
            while True:
                if pending_fill is not None:
                    expr = _FOCUS_BY_LABEL % json.dumps(pending_fill[0])
                    res = await call("Runtime.evaluate", expression=expr, returnByValue=True)
                    if res["result"].get("value") is True:
                        await call("Input.insertText", text=pending_fill[1])
                        pending_fill = None
                page = await text()
                if pending_fill is None and until(page):
                    break
                if time.monotonic() > deadline:
                    await self._screenshot(call, png)
                    raise AssertionError(
                        f"{url}: the page did not show what was expected within "
                        f"{timeout_s:.0f}s (field filled: {pending_fill is None}); its text:\n"
                        f"{page[:3000]}"
                    )
                await asyncio.sleep(0.25)
            await asyncio.sleep(0.5)  # let the last render settle before the picture
            await self._screenshot(call, png)
            return await text()

    @staticmethod
    async def _screenshot(call: Callable[..., Any], png: Path) -> None:
        shot = await call("Page.captureScreenshot", format="png")
        png.write_bytes(base64.b64decode(shot["data"]))
