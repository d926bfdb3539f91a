"""A loopback HTTP proxy between the s3 tier and moto that injects faults on demand.

The tier's ``endpoint_url`` points at the proxy; the proxy forwards each
request to the upstream server (keep-alive, one upstream connection per
client connection) unless a fault is armed:

* ``error(status, code, count=None, methods=None, header=None)``: answer
  with an S3 XML error (``500 InternalError``, ``503 SlowDown``,
  ``501 NotImplemented``...) instead of forwarding, for the next ``count``
  matching requests (all of them if None); ``header`` restricts it to
  requests carrying that header (e.g. ``If-None-Match``).
* ``stall(count=None)``: hold matching requests without answering until
  :meth:`heal` (the client's read timeout fires first).
* ``reset(count=None)``: close the connection with a TCP RST after reading
  the request (what a crashed or restarted server looks like).
* ``truncate(count=None)``: forward, then send the response headers with the
  full Content-Length but only half the body, and close.
* ``heal()``: disarm everything and release stalled requests.

``requests`` counts requests received, by method, faults included; ``seen`` lists each
one's (method, path); ``connections`` counts the client connections that carried a
request (one the client gave up on before sending anything is not a connection it uses).
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
        "upgrade", "expect"}


@dataclass
class _Fault:
    kind: str  # error | stall | reset | truncate
    count: int | None
    methods: frozenset[str] | None
    status: int = 503
    code: str = "ServiceUnavailable"
    header: str | None = None  # only requests carrying this header


class FaultProxy:
    """Start with ``FaultProxy(upstream_url)``; ``url`` is the endpoint to give the tier."""

    def __init__(self, upstream: str, port: int = 0) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.requests: Counter[str] = Counter()
        self.seen: list[tuple[str, str]] = []
        self.connections = 0
        self.faults_served = 0
        self._fault: _Fault | None = None
        self._lock = threading.Lock()
        self._healed = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def handle_one_request(self) -> None:
                try:
                    super().handle_one_request()
                except (ConnectionError, TimeoutError, OSError):
                    self.close_connection = True

            def _any(self) -> None:
                if not getattr(self, "_used", False):
                    self._used = True
                    with proxy._lock:
                        proxy.connections += 1
                proxy._handle(self)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="faultproxy")
        self._thread.start()

    # -- control ---------------------------------------------------------------
    def _arm(self, fault: _Fault) -> None:
        with self._lock:
            self._fault = fault
            self._healed.clear()

    def error(self, status: int = 503, code: str = "ServiceUnavailable",
              count: int | None = None, methods: set[str] | None = None,
              header: str | None = None) -> None:
        self._arm(_Fault("error", count, frozenset(methods) if methods else None, status, code,
                         header))

    def stall(self, count: int | None = None, methods: set[str] | None = None) -> None:
        self._arm(_Fault("stall", count, frozenset(methods) if methods else None))

    def reset(self, count: int | None = None, methods: set[str] | None = None) -> None:
        self._arm(_Fault("reset", count, frozenset(methods) if methods else None))

    def truncate(self, count: int | None = None, methods: set[str] | None = None) -> None:
        self._arm(_Fault("truncate", count, frozenset(methods) if methods else None))

    def heal(self) -> None:
        with self._lock:
            self._fault = None
        self._healed.set()

    def close(self) -> None:
        self.heal()
        self._server.shutdown()
        self._server.server_close()

    def _take_fault(self, method: str, headers: Any, path: str = "") -> _Fault | None:
        with self._lock:
            self.requests[method] += 1
            self.seen.append((method, path))
            f = self._fault
            if f is None or (f.methods is not None and method not in f.methods):
                return None
            if f.header is not None and f.header not in headers:
                return None
            if f.count is not None:
                f.count -= 1
                if f.count <= 0:
                    self._fault = None
            self.faults_served += 1
            return f

    # -- serving ---------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        fault = self._take_fault(h.command, h.headers, h.path)
        if fault is not None and fault.kind == "error":
            xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                   f"<Message>injected by faultproxy</Message></Error>").encode()
            h.send_response(fault.status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(0 if h.command == "HEAD" else len(xml)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(xml)
            return
        if fault is not None and fault.kind == "stall":
            self._healed.wait(60)
            h.close_connection = True
            return
        if fault is not None and fault.kind == "reset":
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            h.close_connection = True
            h.connection.close()
            return
        status, reason, headers, data = self._forward(h, body)
        h.send_response(status, reason)
        for k, v in headers:
            if k.lower() not in _HOP and k.lower() not in ("content-length", "date", "server"):
                h.send_header(k, v)
        clen = next((v for k, v in headers if k.lower() == "content-length"), None)
        if h.command == "HEAD":
            h.send_header("Content-Length", clen or "0")
        else:
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if fault is not None and fault.kind == "truncate" and h.command != "HEAD":
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if h.command != "HEAD":
            h.wfile.write(data)

    def _forward(self, h: BaseHTTPRequestHandler, body: bytes
                 ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = getattr(h, "_upstream", None)
        for attempt in range(2):
            if conn is None:
                conn = http.client.HTTPConnection(*self.upstream, timeout=60)
                h._upstream = conn  # type: ignore[attr-defined]
            try:
                headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
                conn.request(h.command, h.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, resp.reason, resp.getheaders(), data
            except (http.client.HTTPException, OSError):
                conn.close()
                conn = None
                h._upstream = None  # type: ignore[attr-defined]
                if attempt:
                    raise
        raise AssertionError("unreachable")
