"""Serve Prometheus text on ``http://127.0.0.1:PORT/metrics``.

The server never calls into the cache (``HiCache`` is single-threaded): its owner renders
the text on its own thread and hands it over with :meth:`MetricsServer.publish`; a scrape
returns the latest text published. Start and stop it explicitly, or use it as a context
manager::

    with MetricsServer(port=0) as server:      # 0: any free port, see server.port
        server.publish(cache.prometheus())
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

from prometheus_client import CONTENT_TYPE_LATEST

from hicache.errors import ConfigError, MisuseError

HOST = "127.0.0.1"


class MetricsServer:
    """``/metrics`` on 127.0.0.1 only; ``port=0`` binds an ephemeral port."""

    def __init__(self, port: int = 0) -> None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ConfigError(f"metrics port must be an int in [0, 65535], got {port!r}")
        self.requested_port = port
        self._text = b""
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        if self._server is None:
            raise MisuseError("the metrics server is not running")
        return int(self._server.server_address[1])

    def publish(self, text: str) -> None:
        """Make ``text`` what the next scrape returns."""
        if not isinstance(text, str):
            raise MisuseError(f"publish takes the exposition text (a str, as prometheus() returns), got {text!r:.60}")
        try:
            data = text.encode()
        except UnicodeEncodeError as exc:
            raise MisuseError(f"publish takes text that encodes to UTF-8: {exc}") from None
        with self._lock:
            self._text = data

    def _latest(self) -> bytes:
        with self._lock:
            return self._text

    def start(self) -> int:
        """Bind and serve on a daemon thread; returns the bound port. Raises OSError when
        the port is taken."""
        if self._server is not None:
            raise MisuseError("the metrics server is already running")
        latest = self._latest

        class Handler(BaseHTTPRequestHandler):
            # NOTE: a client that never finishes its request frees its thread after this long
            # (one held it past stop(), then answered into a closed socket)
            timeout = 5.0

            def do_GET(self) -> None:
                self._answer(with_body=True)

            def do_HEAD(self) -> None:  # a liveness check: the headers GET would send
                self._answer(with_body=False)

            def _answer(self, *, with_body: bool) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = latest()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if with_body:
                        self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the scraper left: nothing to tell it

            def log_message(self, format: str, *args: object) -> None:
                pass  # a scrape every few seconds would flood stderr

        server = ThreadingHTTPServer((HOST, self.requested_port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="hicache-metrics", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        """Stop serving, close the socket and join the thread (idempotent)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join()

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
