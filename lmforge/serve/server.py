"""Running the app: uvicorn on a socket bound first, so ``port 0`` has its real port to print
before the first request, in the foreground (``lmforge serve``) or on a thread (tests, the
benchmark). A connection must send a request head within ``head_timeout_s``
(``limits.HeadDeadlineProtocol``); past ``max_connections`` open at once a request gets
uvicorn's 503."""

from __future__ import annotations

import socket
import threading

import uvicorn
from fastapi import FastAPI

from lmforge.serve.limits import with_head_timeout


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port the system picks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def uvicorn_server(app: FastAPI, log_level: str = "info", head_timeout_s: float = 10.0,
                   max_connections: int = 256) -> uvicorn.Server:
    # uvicorn counts the connection asking among those open: its limit is one more than ours
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug",
                                         timeout_graceful_shutdown=2, http=with_head_timeout(head_timeout_s),
                                         limit_concurrency=max_connections + 1))


class BackgroundServer:
    """The app served on a thread of this process: ``url`` once started, ``stop()`` to end it."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", **limits):
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        self.server = uvicorn_server(app, log_level, **limits)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="lmforge-http")

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        for _ in range(int(timeout / 0.01)):
            if self.server.started or not self.thread.is_alive():
                break
            self.thread.join(0.01)
        if not self.server.started:
            raise RuntimeError(f"the server on {self.url} did not start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
