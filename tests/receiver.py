"""A webhook receiver for tests: an http.server on 127.0.0.1, in a thread, that records
every request it gets (deliveries, docs/api.md, "Deliveries (webhooks)", are checked against what
arrived, not against what runstile says it sent)."""

from __future__ import annotations

import http.server
import ssl
import threading
import time


class Receiver:
    """``answer(handler, record)`` writes the response (default 204 No Content); each
    recorded request is a dict with ``path``, ``headers`` (lower-case names), ``body``,
    ``at`` (monotonic seconds), ``complete`` (the whole body arrived; an incomplete
    request is not answered) and, once answered, ``status``."""

    def __init__(self, answer=None, tls: ssl.SSLContext | None = None):
        self.requests: list[dict] = []
        self.server_names: list[str | None] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                record = {"path": self.path,
                          "headers": {k.lower(): v for k, v in self.headers.items()},
                          "body": self.rfile.read(length), "at": time.monotonic()}
                # A sender killed mid-request leaves a short body: a real server drops it.
                record["complete"] = len(record["body"]) == length
                with receiver._lock:
                    receiver.requests.append(record)
                if not record["complete"]:
                    return
                status = (answer or no_content)(self, record)
                record["status"] = status

            do_GET = do_POST

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # clients hang up on purpose
        if tls is not None:
            tls.sni_callback = lambda sock, name, ctx: self.server_names.append(name)
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def url(self, host: str = "127.0.0.1", path: str = "/hook", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"

    def received(self) -> list[dict]:
        with self._lock:
            return list(self.requests)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def no_content(handler, record=None) -> int:
    handler.send_response(204)
    handler.end_headers()
    return 204


def answer_with(status: int, headers: dict | None = None, body: bytes = b""):
    def answer(handler, record=None) -> int:
        handler.send_response(status)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
        return status
    return answer
