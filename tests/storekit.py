"""Real servers on 127.0.0.1 for object-store tests: moto's S3, a fault-injecting proxy in
front of it, and a static HTTP server that answers ``Range`` requests.

* :func:`moto_endpoint` starts ``ThreadedMotoServer`` (S3 API) on a free port;
* :class:`FaultProxy` forwards every request to an upstream endpoint unchanged and, while a
  fault rule matches, answers instead: ``503 SlowDown`` (S3's throttling reply), ``500``, or the
  upstream's response with its body cut short (the real ``Content-Length``, fewer bytes, then
  the connection closed); it counts the requests it saw, so a test can tell that a client
  retried;
* :class:`RangeHTTPServer` serves a directory over plain HTTP with ``Range``/``HEAD`` support
  (``http.server``'s own handler ignores ``Range``).

No mocks of the client: whatever library sends the requests meets a real socket.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Fault", "FaultProxy", "RangeHTTPServer", "moto_endpoint"]

_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@contextlib.contextmanager
def moto_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 for the block (credentials come from the environment)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@dataclass
class Fault:
    """Answer the next ``times`` requests whose method is ``method`` (``None``: any) and whose
    path matches ``path`` (a regex searched in the request path) with ``kind``:
    ``"503"`` (SlowDown), ``"500"`` or ``"truncate"`` (the upstream's answer, half its body)."""

    kind: str
    times: int
    method: str | None = "GET"
    path: str = ""
    hits: int = 0


@dataclass
class _Stats:
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, range)
    headers: list[dict[str, str]] = field(default_factory=list)  # of each request, in order


class FaultProxy:
    """A forwarding HTTP/1.1 proxy on 127.0.0.1 that injects faults (see module docstring).

    ``with FaultProxy(upstream) as p: ... p.endpoint``; ``p.faults.append(Fault(...))`` arms a
    rule; ``p.requests`` lists what arrived (method, path, Range header).
    """

    def __init__(self, upstream: str) -> None:
        m = re.match(r"^http://([^:/]+):(\d+)$", upstream)
        if not m:
            raise ValueError(f"upstream={upstream!r}: expected http://HOST:PORT")
        self.upstream = (m.group(1), int(m.group(2)))
        self.faults: list[Fault] = []
        self.stats = _Stats()
        self.delay_body_s = 0.0  # seconds to sleep between body chunks (a slow server)
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def requests(self) -> list[tuple[str, str, str]]:
        with self._lock:
            return list(self.stats.requests)

    @property
    def headers(self) -> list[dict[str, str]]:
        """The headers of each request in :attr:`requests` (names lower-cased)."""
        with self._lock:
            return list(self.stats.headers)

    def _fault_for(self, h: http.server.BaseHTTPRequestHandler) -> Fault | None:
        method, path, rng = h.command, h.path, h.headers.get("Range", "")
        with self._lock:
            self.stats.requests.append((method, path, rng))
            self.stats.headers.append({k.lower(): v for k, v in h.headers.items()})
            for f in self.faults:
                if f.hits < f.times and f.method in (None, method) and re.search(f.path, path):
                    f.hits += 1
                    return f
        return None

    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        n = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(n) if n else b""
        fault = self._fault_for(h)
        if fault is not None and fault.kind in ("503", "500"):
            msg = _SLOWDOWN if fault.kind == "503" else b"<Error><Code>InternalError</Code></Error>"
            h.send_response(int(fault.kind))
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(msg)))
            h.end_headers()
            h.wfile.write(msg)
            return
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() != "connection"}
            conn.request(h.command, h.path, body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
            h.send_response(r.status, r.reason)
            for k, v in r.getheaders():
                if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                    h.send_header(k, v)
            # a HEAD answer has no body but the object's length
            length = r.getheader("Content-Length") if h.command == "HEAD" else None
            h.send_header("Content-Length", length or str(len(data)))
            if fault is not None and fault.kind == "truncate":
                h.send_header("Connection", "close")
                h.end_headers()
                h.wfile.write(data[: len(data) // 2])
                h.wfile.flush()
                h.close_connection = True
                return
            h.end_headers()
            if h.command == "HEAD":
                return
            self._write_body(h, data)
        finally:
            conn.close()

    def _write_body(self, h: http.server.BaseHTTPRequestHandler, data: bytes) -> None:
        if not self.delay_body_s:
            h.wfile.write(data)
            return
        import time

        step = 64 << 10
        for i in range(0, len(data), step):
            h.wfile.write(data[i : i + step])
            h.wfile.flush()
            time.sleep(self.delay_body_s)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with ``Range: bytes=A-B`` answered ``206`` (or ``416`` past the end)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a: Any) -> None:
        pass

    def _file(self) -> str | None:
        p = self.translate_path(self.path)
        return p if os.path.isfile(p) else None

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        p = self._file()
        if p is None:
            self.send_error(404)
            return
        size = os.path.getsize(p)
        start, end = 0, size  # end exclusive
        status = 200
        m = re.match(r"^bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
        if m:
            start = int(m.group(1))
            end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Last-Modified", self.date_time_string(int(os.path.getmtime(p))))
        self.send_header("ETag", f'"{size}-{int(os.path.getmtime(p))}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if body:
            with open(p, "rb") as f:
                f.seek(start)
                self.wfile.write(f.read(end - start))


class RangeHTTPServer:
    """``with RangeHTTPServer(directory) as s: s.url`` -> ``http://127.0.0.1:PORT``."""

    def __init__(self, directory: str) -> None:
        def handler(*a: Any, **kw: Any) -> _RangeHandler:
            return _RangeHandler(*a, directory=directory, **kw)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> RangeHTTPServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
