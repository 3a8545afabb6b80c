"""``harbor-async view``: the report served on 127.0.0.1, rebuilt when the job's records change.

The page asks ``/__version`` every few seconds (``static/live.js``) and
reloads when the version changed: the version is the size and modification
time of the files the report is made from, so a running job's page follows
each finished episode. The report is rebuilt at most once per version, on the
first request that sees it, whatever the number of open tabs.

Only requests naming the server itself in their ``Host`` header
(``127.0.0.1:PORT`` or ``localhost:PORT``) are answered: a page from
elsewhere that the operator opens could otherwise read the report through a
name it re-points at 127.0.0.1 (DNS rebinding).
"""

from __future__ import annotations

import hashlib
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import cast

from harbor_async.core.errors import HarborAsyncError
from harbor_async.core.logs import get_logger
from harbor_async.report.render import render
from harbor_async.report.source import BenchmarkSource, load_source

log = get_logger(__name__)

HOST = "127.0.0.1"


class ReportServer(ThreadingHTTPServer):
    """An HTTP server on 127.0.0.1 for one job folder or benchmark results.

    ``port=0`` picks a free port (see :attr:`url`). Use :meth:`serve_forever`,
    or :meth:`start` and :meth:`stop` to run it on a thread.
    """

    daemon_threads = True

    def __init__(self, path: str | Path, *, port: int = 0, success_threshold: float | None = None) -> None:
        self.source_path = Path(path)
        self.success_threshold = success_threshold
        self._lock = threading.Lock()
        self._page: tuple[str, bytes] | None = None
        self._thread: threading.Thread | None = None
        # Read once now: fails before listening if the path holds nothing to
        # show, and tells which files to watch (polls must not parse records).
        source = load_source(self.source_path)
        self._watch_folder = isinstance(source, BenchmarkSource) and self.source_path.is_dir()
        self._watched = source.watched
        super().__init__((HOST, port), _Handler)

    @property
    def hosts(self) -> frozenset[str]:
        """The ``Host`` header values this server answers (its own address, by number or as localhost)."""
        port = self.server_address[1]
        return frozenset({f"{HOST}:{port}", f"localhost:{port}"})

    @property
    def url(self) -> str:
        """The page's address."""
        host, port = cast(tuple[str, int], self.server_address[:2])  # a TCP server
        return f"http://{host}:{port}/"

    def version(self) -> str:
        """A token that changes whenever a file the report is made from changes."""
        digest = hashlib.sha256()
        watched = sorted(self.source_path.glob("*.json")) if self._watch_folder else self._watched
        for path in watched:
            try:
                stat = path.stat()
            except OSError:
                digest.update(f"{path}:-\n".encode())
                continue
            digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
        return digest.hexdigest()[:16]

    def page(self) -> bytes:
        """The report's HTML for the current version (rebuilt only when the version changed)."""
        with self._lock:
            version = self.version()
            if self._page is None or self._page[0] != version:
                log.info("report.render", path=str(self.source_path), version=version)
                html = render(self.source_path, success_threshold=self.success_threshold, live=version)
                self._page = (version, html.encode("utf-8"))
            return self._page[1]

    def start(self) -> str:
        """Serve on a daemon thread; returns :attr:`url`."""
        self._thread = threading.Thread(target=self.serve_forever, name="harbor-async-view", daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)


class _Handler(BaseHTTPRequestHandler):
    server: ReportServer

    def do_GET(self) -> None:
        if (self.headers.get("Host") or "").strip().lower() not in self.server.hosts:
            self._send(HTTPStatus.MISDIRECTED_REQUEST, "text/plain; charset=utf-8", b"not this server's host\n")
            return
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html", "/report.html"):
            try:
                page = self.server.page()
            except (HarborAsyncError, OSError, ValueError) as exc:
                log.warning("report.render_failed", error=str(exc))
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "text/plain; charset=utf-8", f"cannot build the report: {exc}\n".encode())
                return
            self._send(HTTPStatus.OK, "text/html; charset=utf-8", page)
        elif path == "/__version":
            self._send(HTTPStatus.OK, "text/plain; charset=utf-8", self.server.version().encode())
        else:
            self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found\n")

    def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("report.request", request=format % args)
