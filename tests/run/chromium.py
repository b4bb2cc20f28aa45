"""A real headless Chromium, driven over the DevTools protocol on a pipe.

`chromium --remote-debugging-pipe` reads DevTools commands from fd 3 and writes replies
and events to fd 4 (NUL-terminated JSON): no websocket, no driver package, nothing but
Debian's `chromium` (installed by .ci/chromium-deps.sh). `open_page` loads a page,
collects what the browser reports as errors (uncaught exceptions, console.error, failed
loads and other error log entries), evaluates a script in it and takes a full-page PNG.

    with Chromium() as browser:
        page = browser.open_page(path, script="document.querySelectorAll('svg').length")
        assert not page.errors and page.value > 0
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-quic", "--disable-extensions", "--disable-default-apps", "--mute-audio",
    "--hide-scrollbars", "--remote-debugging-pipe", "about:blank",
)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class Page:
    """What loading one page gave: errors the browser reported, the script's value,
    the screenshot's PNG bytes."""

    url: str
    errors: list[str] = field(default_factory=list)
    value: Any = None
    png: bytes = b""


class Chromium:
    def __init__(self, executable: str | None = None, timeout_s: float = 30.0) -> None:
        exe = executable or find_chromium()
        if exe is None:
            raise FileNotFoundError("no chromium on PATH (.ci/chromium-deps.sh installs it)")
        self._exe, self._timeout = exe, timeout_s
        self._id = 0
        self._buf = b""

    def __enter__(self) -> Chromium:
        self._profile = tempfile.mkdtemp(prefix="tidal-chromium-")
        self._log = (Path(self._profile) / "stderr.log").open("wb")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # the browser's fd 3 reads our commands, its fd 4 writes replies and events (bash:
        # dash takes no fd above 9 in a redirection)
        move = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w}'
        self._proc = subprocess.Popen(
            ["/bin/bash", "-c", move, self._exe, f"--user-data-dir={self._profile}", *FLAGS],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
            pass_fds=(to_browser_r, from_browser_w),
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._send("Browser.close")
            self._proc.wait(timeout=10)
        except Exception:
            self._proc.kill()
            self._proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        self._log.close()
        if os.environ.get("TIDAL_KEEP_CHROMIUM_LOG"):
            print((Path(self._profile) / "stderr.log").read_text())
        shutil.rmtree(self._profile, ignore_errors=True)

    # ------------------------------------------------------------------ protocol
    def _send(self, method: str, session: str | None = None, **params: Any) -> int:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session is not None:
            msg["sessionId"] = session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        return self._id

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        return json.loads(raw)  # type: ignore[no-any-return]

    def call(self, method: str, session: str | None = None, *, events: list[dict[str, Any]]
             | None = None, **params: Any) -> dict[str, Any]:
        """Send a command, wait for its reply; events that arrive meanwhile are kept."""
        want = self._send(method, session, **params)
        deadline = time.monotonic() + self._timeout
        while True:
            msg = self._read(deadline)
            if msg.get("id") == want:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})  # type: ignore[no-any-return]
            if events is not None and "method" in msg:
                events.append(msg)

    def wait_event(self, name: str, events: list[dict[str, Any]]) -> None:
        deadline = time.monotonic() + self._timeout
        while not any(e["method"] == name for e in events):
            events.append(self._read(deadline))

    # ------------------------------------------------------------------ pages
    def open_page(self, path: Path, *, script: str = "null", width: int = 1280,
                  screenshot: bool = True) -> Page:
        url = path.resolve().as_uri()
        events: list[dict[str, Any]] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        sid = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", sid, events=events)
        self.call("Emulation.setDeviceMetricsOverride", sid, events=events, width=width,
                  height=900, deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", sid, events=events, url=url)
        self.wait_event("Page.loadEventFired", events)
        page = Page(url)
        res = self.call("Runtime.evaluate", sid, events=events, expression=script,
                        returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            page.errors.append(f"script: {res['exceptionDetails'].get('text')}")
        page.value = res.get("result", {}).get("value")
        if screenshot:
            size = self.call("Page.getLayoutMetrics", sid, events=events)["cssContentSize"]
            shot = self.call("Page.captureScreenshot", sid, events=events, format="png",
                             captureBeyondViewport=True,
                             clip={"x": 0, "y": 0, "width": width,
                                   "height": min(size["height"], 16000), "scale": 1})
            page.png = base64.b64decode(shot["data"])
        page.errors += _errors(e for e in events if e.get("sessionId") == sid)
        self.call("Target.closeTarget", targetId=target)
        return page


def _errors(events: Any) -> list[str]:
    out = []
    for e in events:
        p = e.get("params", {})
        if e["method"] == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
        elif e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console.error: " + " ".join(str(a.get("value", a.get("description")))
                                                    for a in p.get("args", [])))
        elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            entry = p["entry"]
            out.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}")
    return out
