"""The engine on its own thread: the one owner of the model, fed by the HTTP handlers.

Handlers never touch the engine. ``EngineWorker.submit`` puts a request on a command queue
and returns a ``Ticket``; the engine thread admits it into the continuously batched decode,
and every token it keeps (``Request.on_token``) and the finished generations are handed back
to the handler's asyncio loop as events on the ticket's queue. ``cancel`` (a client gone
mid-stream) takes the request out of the queue or the batch at the engine's next step, so
its slot goes to the next waiting request. A request the engine fails alone gets its error
event; a step that fails as a whole fails the requests it held, and the engine is rebuilt.

At most ``max_pending`` requests are held at once (decoding or waiting); one more is refused
(``QueueFull``, HTTP 429) instead of waiting without bound.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch

from lmforge.inference.engine import Engine, Request

log = logging.getLogger("lmforge.serve")


class QueueFull(Exception):
    """More requests than ``max_pending`` are waiting or decoding."""


@dataclass
class Ticket:
    """One submitted request, as its handler sees it: events arrive on ``events`` (which several
    tickets of one HTTP request may share) as ``(tag, "token", sample, token, logprob, top)``,
    then ``(tag, "done", generations)`` or ``(tag, "error", exception)``."""

    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    tag: int = 0
    engine_id: int | None = None
    closed: bool = False  # finished, failed or cancelled: no more events


def deliver(events: list[tuple[Ticket, tuple]]) -> None:
    """Put a step's events on their tickets' queues (on the handlers' loop)."""
    for ticket, event in events:
        ticket.events.put_nowait((ticket.tag, *event))


class EngineWorker:
    """Runs ``engine`` on a daemon thread; thread-safe ``submit`` and ``cancel``."""

    def __init__(self, engine: Engine, max_pending: int = 64):
        self.engine, self.max_pending = engine, max_pending
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.pending = 0  # submitted, not yet finished or cancelled
        self.tickets: dict[int, Ticket] = {}  # engine id -> ticket (engine thread only)
        self.stats = {"waiting": 0, "decoding": 0, "finished": 0, "cancelled": 0}
        self.outbox: list[tuple[Ticket, tuple]] = []  # this step's events, handed over together
        self.thread = threading.Thread(target=self.loop, name="lmforge-engine", daemon=True)
        self.stopping = False

    def start(self) -> EngineWorker:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping = True
        self.commands.put(("stop", None))
        self.thread.join(timeout=10)

    # -- the handlers' side
    def submit(self, request: Request, events: asyncio.Queue, tag: int = 0, stream: bool = False) -> Ticket:
        """Queue ``request`` (from the asyncio loop that reads ``events``); with ``stream`` its
        tokens are delivered as they are chosen. Raises ``QueueFull`` past ``max_pending``."""
        with self.lock:
            if self.pending >= self.max_pending:
                raise QueueFull(f"the server holds {self.pending} requests (max_pending {self.max_pending}); retry later")
            self.pending += 1
        ticket = Ticket(request, asyncio.get_running_loop(), events, tag)
        if stream:
            request.on_token = lambda sample, token, logprob, top: self.emit(ticket, "token", sample, token, logprob, top)
        self.commands.put(("submit", ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Drop a request that is no longer wanted (its client went away)."""
        if not ticket.closed:
            self.commands.put(("cancel", ticket))

    # -- the engine thread
    def loop(self) -> None:
        with torch.inference_mode():
            while not self.stopping:
                idle = not (self.engine.queue or self.engine.rows)
                try:
                    self.run_command(self.commands.get(block=idle))
                    while True:
                        self.run_command(self.commands.get_nowait())
                except queue.Empty:
                    pass
                if self.engine.queue or self.engine.rows:
                    self.step()
                self.stats.update(waiting=len(self.engine.queue), decoding=len(self.engine.rows))
                self.flush()

    def emit(self, ticket: Ticket, *event: Any) -> None:
        self.outbox.append((ticket, event))

    def flush(self) -> None:
        """Hand the step's events to the handlers' loops, one wake-up per loop and step, not per token."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Ticket, tuple]]] = {}
        for ticket, event in self.outbox:
            by_loop.setdefault(ticket.loop, []).append((ticket, event))
        self.outbox = []
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, events)
            except RuntimeError:  # the loop has closed: the server is shutting down
                pass

    def run_command(self, command: tuple[str, Ticket | None]) -> None:
        kind, ticket = command
        if kind == "submit":
            try:
                ticket.engine_id = self.engine.submit(ticket.request)
            except ValueError as exc:
                self.close(ticket, "error", exc)
                return
            self.tickets[ticket.engine_id] = ticket
        elif kind == "cancel" and not ticket.closed:
            if ticket.engine_id is not None:
                self.engine.cancel(ticket.engine_id)
                self.tickets.pop(ticket.engine_id, None)
            self.stats["cancelled"] += 1
            self.close(ticket)

    def step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, never the server
            log.exception("the engine failed a step; its requests get an error")
            for ticket in list(self.tickets.values()):
                self.close(ticket, "error", exc)
            self.tickets.clear()
            self.engine = Engine(self.engine.model, self.engine.tokenizer, self.engine.max_batch, self.engine.kv_cache_dtype)
            return
        for engine_id, generations in finished:
            ticket = self.tickets.pop(engine_id, None)
            if ticket is not None:
                self.stats["finished"] += 1
                self.close(ticket, "done", generations)
        for engine_id, error in self.engine.take_failures():  # one request's error: the others decode on
            ticket = self.tickets.pop(engine_id, None)
            log.warning("a request failed alone: %s: %s", type(error).__name__, error)
            if ticket is not None:
                self.close(ticket, "error", error)

    def close(self, ticket: Ticket, *event: Any) -> None:
        ticket.closed = True
        with self.lock:
            self.pending -= 1
        if event:
            self.emit(ticket, *event)
