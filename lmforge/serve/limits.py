"""What one client can hold of the server: a request body's size and the time to send it (an
ASGI middleware), and the time to send a request's head (uvicorn's h11 protocol with a timer).

``BodyLimits`` reads a request's whole body before the app sees it: a ``Content-Length`` past
``max_bytes`` is a 413 at once, without reading; a body that grows past it while read, a 413;
one not complete within ``timeout_s`` of its head, a 408 and the connection closed. Both are
OpenAI's JSON error. The rest of a refused body is read and dropped by uvicorn, within the
head deadline below. ``HeadDeadlineProtocol`` closes a connection that has not sent a whole
request head within ``timeout`` of opening or of its last response (a silent socket, partial
headers sent a byte at a time), which uvicorn's keep-alive timeout does not (any byte stops it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from lmforge.serve.protocol import APIError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class BodyLimits:
    """An ASGI middleware: bodies past ``max_bytes`` get 413, bodies not complete within ``timeout_s`` 408."""

    def __init__(self, app: Callable, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit():
            return await refuse(scope, receive, send, APIError(400, "the Content-Length header is not a number",
                                                              code="invalid_request"))
        if int(length) > self.max_bytes:
            return await refuse(scope, receive, send, self.too_large(int(length)))
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_bytes:
                        return await refuse(scope, receive, send, self.too_large(size, sent=True))
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            error = APIError(408, f"the request body took longer than {self.timeout_s:g} s to arrive (body_timeout_s); "
                                  "send it whole, at once", code="request_timeout")
            return await refuse(scope, receive, send, error, close=True)
        body, replayed = b"".join(chunks), False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: a disconnect, which a stream listens for
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def too_large(self, size: int, sent: bool = False) -> APIError:
        return APIError(413, f"the request body {'has more than' if sent else 'is'} {size} bytes; this server takes at "
                             f"most {self.max_bytes} (max_body_bytes): send a shorter prompt",
                        code="request_too_large")


async def refuse(scope: Scope, receive: Receive, send: Send, error: APIError, close: bool = False) -> None:
    headers = {"connection": "close"} if close else None
    await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request head is not complete
    within ``head_timeout_s`` of opening or of the last response. Set ``head_timeout_s`` on a
    subclass (``with_head_timeout``)."""

    head_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_deadline: asyncio.TimerHandle | None = None
        self.arm_head_deadline()

    def arm_head_deadline(self) -> None:
        self.cancel_head_deadline()
        self.head_deadline = self.loop.call_later(self.head_timeout_s, self.head_deadline_passed, self.cycle)

    def cancel_head_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a new request's head arrived: the app has it now
            self.cancel_head_deadline()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self.arm_head_deadline()  # before: a pipelined request already here cancels it
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_head_deadline()
        super().connection_lost(exc)

    def head_deadline_passed(self, cycle: object) -> None:
        if self.cycle is cycle and not self.transport.is_closing():  # still no new request
            self.transport.close()


def with_head_timeout(seconds: float) -> type[HeadDeadlineProtocol]:
    """The protocol class for uvicorn's ``http=`` with a head deadline of ``seconds``."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout_s": seconds})
