"""An HTTP proxy on loopback between a client and the real S3 server, injecting faults as a client
sees them on the wire:

- `fail_first=N`: the first N counted requests get an S3 error and never reach the server
  (throttling, a 5xx before the write); `methods` / `path_contains` / `header` restrict which
  requests count (default: all);
- `corrupt=True`: counted requests are forwarded and one byte of the response body is flipped
  (a corrupted GET);
- `hold` (a threading.Event): counted requests wait until it is set, then are forwarded (a writer
  paused between its check and its upload);
- `lose_responses=N`: the first N requests that `match` ARE forwarded, so the server carries
  them out, and the client then gets the error instead of the server's answer (a response lost
  after the write: the client's retry of a conditional PUT meets its own object);
- `fail_matching=True`: every request that `match`es gets the error (a store that refuses, say,
  every PUT);
- `strip_headers`: these request headers never reach the server (a proxy or server that ignores
  `If-None-Match`; moto does not check signatures, so the request still goes through).

`match(method, path)` picks the requests the last two modes apply to (default: all).
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


def puts_ending_with(*suffixes: str) -> Callable[[str, str], bool]:
    """A `match` for PUTs of keys ending with one of `suffixes` (query string ignored)."""
    return lambda method, path: method == "PUT" and path.split("?", 1)[0].endswith(suffixes)


class FaultProxy:
    def __init__(self, upstream: str, fail_first: int = 0, status: int = 503, code: str = "SlowDown", *,
                 methods: tuple[str, ...] | None = None, path_contains: str | None = None,
                 header: str | None = None, corrupt: bool = False, hold: threading.Event | None = None,
                 lose_responses: int = 0, fail_matching: bool = False,
                 match: Callable[[str, str], bool] | None = None, strip_headers: tuple[str, ...] = ()):
        self.upstream = urlsplit(upstream)
        self.remaining = fail_first
        self.lose_remaining = lose_responses
        self.fail_matching = fail_matching
        self.match = match or (lambda method, path: True)
        self.failed = 0
        self.forwarded = 0
        self.corrupted = 0
        self.held = 0
        self.lost = 0  # forwarded, then answered with the error
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status the client got)
        self.status, self.code = status, code
        self.methods, self.path_contains, self.header = methods, path_contains, header
        self.corrupt, self.hold = corrupt, hold
        self.lock = threading.Lock()
        self.strip = {h.lower() for h in strip_headers} | {"connection"}
        proxy = self

        def counts(handler) -> bool:
            return ((proxy.methods is None or handler.command in proxy.methods)
                    and (proxy.path_contains is None or proxy.path_contains in handler.path)
                    and (proxy.header is None or handler.headers.get(proxy.header) is not None))

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                matched = proxy.match(self.command, self.path)
                with proxy.lock:
                    hit = proxy.remaining > 0 and counts(self)
                    if hit:
                        proxy.remaining -= 1
                    fail = (hit and not proxy.corrupt and proxy.hold is None) or (proxy.fail_matching and matched)
                    lose = not fail and matched and proxy.lose_remaining > 0
                    if fail:
                        proxy.failed += 1
                    else:
                        proxy.forwarded += 1
                    if lose:
                        proxy.lose_remaining -= 1
                        proxy.lost += 1
                if hit and proxy.hold is not None:
                    proxy.held += 1
                    proxy.hold.wait(timeout=120)
                if fail:
                    self._send_error()
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in proxy.strip}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                if lose:
                    self._send_error()
                    return
                if hit and proxy.corrupt and data and resp.status in (200, 206):
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                    proxy.corrupted += 1
                with proxy.lock:
                    proxy.requests.append((self.command, self.path, resp.status))
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _send_error(self):
                msg = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{proxy.code}</Code>"
                       f"<Message>injected</Message></Error>").encode()
                with proxy.lock:
                    proxy.requests.append((self.command, self.path, proxy.status))
                self.send_response(proxy.status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(msg)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
