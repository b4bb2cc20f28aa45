"""Allow-listed loopback ports: 127.0.0.1:P inside the sandbox -> 127.0.0.1:P on the host.

A sandbox has its own network namespace holding only a loopback interface, so nothing
outside is reachable. For each allowed port the host process creates a listening
socket *inside* that namespace (a socket belongs to the namespace of the thread that
created it; the thread enters it for that one call) and relays each accepted
connection to the same port on the host's loopback. Nothing runs inside the sandbox and
nothing else of the host's network becomes reachable.

If nothing listens on the host port, the sandbox's connection is accepted and then
closed at once (the client sees EOF rather than "connection refused").
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading

from tidal.sandbox._linux import CLONE_NEWNET, thread_in_namespaces

_BUF = 1 << 16


class PortForwarder:
    def __init__(self, netns_fd: int, ports: tuple[int, ...], host: str = "127.0.0.1"):
        self.host = host
        self._listeners: dict[socket.socket, int] = {}
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        with thread_in_namespaces([(netns_fd, CLONE_NEWNET)]):
            socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in ports]
        try:
            for s, port in zip(socks, ports, strict=True):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
                s.listen(64)
                s.setblocking(False)
                self._listeners[s] = port
        except BaseException:
            for s in socks:
                s.close()
            raise
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._accept_loop, name="tidal-sandbox-ports",
                                        daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        for s in self._listeners:
            sel.register(s, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._closed:
                for key, _ in sel.select():
                    if key.fileobj == self._wake_r:
                        return
                    lsock = key.fileobj
                    assert isinstance(lsock, socket.socket)
                    try:
                        inner, _ = lsock.accept()
                    except BlockingIOError:
                        continue
                    threading.Thread(target=self._relay, args=(inner, self._listeners[lsock]),
                                     name="tidal-sandbox-relay", daemon=True).start()
        finally:
            sel.close()

    def _relay(self, inner: socket.socket, port: int) -> None:
        inner.setblocking(True)
        try:
            outer = socket.create_connection((self.host, port), timeout=5)
        except OSError:
            inner.close()
            return
        outer.settimeout(None)
        with self._lock:
            if self._closed:
                inner.close()
                outer.close()
                return
            self._conns.update((inner, outer))
        peer = {inner: outer, outer: inner}
        sel = selectors.DefaultSelector()
        sel.register(inner, selectors.EVENT_READ)
        sel.register(outer, selectors.EVENT_READ)
        open_dirs = 2
        try:
            while open_dirs:
                for key, _ in sel.select():
                    src = key.fileobj
                    assert isinstance(src, socket.socket)
                    try:
                        data = src.recv(_BUF)
                    except OSError:
                        data = b""
                    if data:
                        peer[src].sendall(data)
                    else:
                        sel.unregister(src)
                        open_dirs -= 1
                        with contextlib.suppress(OSError):
                            peer[src].shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            sel.close()
            with self._lock:
                self._conns.discard(inner)
                self._conns.discard(outer)
            inner.close()
            outer.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=2)
        for s in self._listeners:
            s.close()
        with self._lock:
            for c in list(self._conns):
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
        os.close(self._wake_r)
        os.close(self._wake_w)
