"""An HTTP proxy on loopback that answers the first N requests with an S3 error, then forwards
everything to the real server: transient 5xx / throttling as a client sees it on the wire.

Optional filters and modes (reliability tests): `methods` / `path_contains` / `header` restrict
which requests count; `corrupt=True` forwards a counted request and flips one byte of its
response body (a corrupted GET); `hold` (a threading.Event) makes counted requests wait until it
is set, then forwards them (a writer paused between its check and its upload)."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class FaultProxy:
    def __init__(self, upstream: str, fail_first: int, status: int = 503, code: str = "SlowDown", *,
                 methods: tuple[str, ...] | None = None, path_contains: str | None = None,
                 header: str | None = None, corrupt: bool = False, hold: threading.Event | None = None):
        self.upstream = urlsplit(upstream)
        self.remaining = fail_first
        self.failed = 0
        self.forwarded = 0
        self.corrupted = 0
        self.held = 0
        self.status, self.code = status, code
        self.methods, self.path_contains, self.header = methods, path_contains, header
        self.corrupt, self.hold = corrupt, hold
        self.lock = threading.Lock()
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
                with proxy.lock:
                    hit = proxy.remaining > 0 and counts(self)
                    if hit:
                        proxy.remaining -= 1
                    fail = hit and not proxy.corrupt and proxy.hold is None
                    if fail:
                        proxy.failed += 1
                    else:
                        proxy.forwarded += 1
                if hit and proxy.hold is not None:
                    proxy.held += 1
                    proxy.hold.wait(timeout=120)
                if fail:
                    msg = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{proxy.code}</Code>"
                           f"<Message>injected</Message></Error>").encode()
                    self.send_response(proxy.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if hit and proxy.corrupt and data and resp.status in (200, 206):
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                    proxy.corrupted += 1
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

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
