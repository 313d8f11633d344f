"""A threaded HTTP/1.1 server on 127.0.0.1 for the servers the tests run (GitHub's releases API, a
package index, the Hub, a plain Range server): each gives the function that answers a request."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["LocalHTTP"]


class LocalHTTP:
    """`answer(handler, head)` answers every GET (head=False) and HEAD (head=True)."""

    def __init__(self, answer: Callable[[BaseHTTPRequestHandler, bool], None]) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                answer(self, False)

            def do_HEAD(self) -> None:
                answer(self, True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
