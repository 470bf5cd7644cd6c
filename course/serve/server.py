"""Run an ASGI app with uvicorn in a background thread, on a free port of 127.0.0.1, and stop it cleanly.

    with ServerThread(app) as server:          # returns once the socket listens
        httpx.get(server.url + "/health")
    # here uvicorn has shut down: lifespan shutdown ran (the engine loop stopped), the thread ended

A notebook cell must not block on `uvicorn.run`, so the server gets its own thread and event loop.
Stopping sets uvicorn's `should_exit`: it stops accepting, lets open responses finish (a few seconds
at most, then closes them), runs the app's shutdown, and the thread ends. The thread is a daemon, so
a kernel that shuts down takes it along. Logs go to `server.logs` (a list), never to stderr, so a
notebook cell running while the server works prints nothing it did not ask for.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.asgi", "asyncio")   # asyncio: "Task exception was never retrieved"


class _ListHandler(logging.Handler):
    def __init__(self, records: list[str]):
        super().__init__(logging.INFO)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


class ServerThread:
    """uvicorn serving `app` on host:port (port 0: a free one) in a daemon thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                 graceful_s: float = 5.0):
        if type(port) is not int or not 0 <= port < 65536:
            raise ValueError(f"port must be an int in 0..65535 (0: any free port), got {port!r}")
        self.app, self.host, self.timeout_s = app, host, timeout_s
        self.logs: list[str] = []
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))                # bound here, so the port is known before uvicorn starts
        self.port = self.sock.getsockname()[1]
        self.config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", loop="asyncio",
                                     http="h11", ws="none", timeout_graceful_shutdown=graceful_s)
        self.server = uvicorn.Server(self.config)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> "ServerThread":
        """Start serving; returns once uvicorn listens (RuntimeError if it fails to within timeout_s)."""
        if self.thread is not None:
            raise RuntimeError("this server was started already; make a new ServerThread")
        handler = _ListHandler(self.logs)
        for name in LOGGERS:
            log = logging.getLogger(name)
            log.handlers, log.propagate, log.level = [handler], False, logging.INFO
        logging.getLogger("uvicorn.access").disabled = True
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start within {self.timeout_s} s; its log: {self.logs[-5:]}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Ask uvicorn to exit and wait for its thread (open streams are closed after `graceful_s`)."""
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(self.timeout_s)
            if self.thread.is_alive():
                self.server.force_exit = True
                self.thread.join(self.timeout_s)
        self.sock.close()

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerThread({self.url}, {'running' if self.running else 'stopped'})"
