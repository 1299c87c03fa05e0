"""A headless Chromium driven over the DevTools protocol (no browser download: Debian's
``chromium``, and ``websocket-client`` from PyPI). Used by the dashboard test."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    """One headless browser with a fresh profile and one page."""

    def __init__(
        self, binary: str, width: int = 1400, height: int = 1640, *, offline: bool = False
    ) -> None:
        """``offline``: every host name but the loopback addresses fails to resolve, as on a
        machine without internet (a page that needs a CDN breaks)."""
        self._profile = tempfile.mkdtemp(prefix="expertmesh-chromium-")
        self.proc = subprocess.Popen(
            [
                binary,
                *FLAGS,
                f"--user-data-dir={self._profile}",
                "--remote-debugging-port=0",
                f"--window-size={width},{height}",
                *(["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"] if offline else []),
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("chromium did not start")
            time.sleep(0.05)
        self.ws: Any = None
        self._ids = itertools.count(1)
        self.console: list[str] = []
        try:  # never leave a browser behind if connecting fails
            port = int(port_file.read_text().split()[0])
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                pages = [t for t in json.load(r) if t["type"] == "page"]
            self.ws = websocket.create_connection(
                pages[0]["webSocketDebuggerUrl"], timeout=30, suppress_origin=True
            )
            self.call("Runtime.enable")
            self.call("Page.enable")
            self.call("Log.enable")
        except BaseException:
            self.close()
            raise

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if msg.get("method") == "Runtime.exceptionThrown":
                self.console.append(json.dumps(msg["params"]["exceptionDetails"])[:500])
            if msg.get("method") == "Log.entryAdded" and msg["params"]["entry"]["level"] == "error":
                entry = msg["params"]["entry"]
                self.console.append(f"{entry['text']} {entry.get('url', '')}")

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def eval(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while True:
            try:
                value = self.eval(expression)
            except RuntimeError as err:  # e.g. the page is still loading
                value, last = None, err
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {expression} ({last})")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=False)
        path.write_bytes(base64.b64decode(data["data"]))

    def close(self) -> None:
        try:
            if getattr(self, "ws", None) is not None:
                self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            shutil.rmtree(self._profile, ignore_errors=True)
