"""The HTTP routes: OpenAI's models, chat completions and completions, vLLM's tokenize and
detokenize, a health check, and the chat page at ``/``.

Every generation is one request to the engine worker (``worker.py``). A chat request is
rendered with the ChatML template (``data.chat.chat_prompt_ids``) and stops at
``<|im_end|>`` or end of text, as ``lmforge generate``'s chat mode does. A completion's
prompt is text (BOS + its tokens) or token ids, one or a batch; with ``echo`` and
``logprobs`` the answer carries every prompt token's log-probability from the prefill's
forward, which is how lm-evaluation-harness's ``local-completions`` model scores a
continuation (``max_tokens`` 0 scores the prompt alone). A completion that ends at a stop
token lists that token in ``logprobs`` (not in the text), as vLLM does, so a scorer that
drops the last entry drops the generated token. ``usage`` counts the prompt once and every
generated token, the stop token included.

``stream: true`` answers with server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``; a client that goes away mid-stream has its request cancelled in the engine,
and a stream that fails sends an error event, then ``[DONE]``.

What one request can cost the others is bounded: a body past ``max_body_bytes`` is a 413
(``limits.BodyLimits``), a text longer than the context could hold (``max_len`` tokens times
the longest token's characters) is a 400 before it is tokenized, and prompts are tokenized on
a worker thread, not on the event loop that answers every other client.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from lmforge.core.io import InputError
from lmforge.data.chat import chat_prompt_ids
from lmforge.data.chatml import CHATML_TEMPLATE, IM_END, ExampleError, render_chatml, validate_messages
from lmforge.data.tokenizer import Tokenizer
from lmforge.inference.engine import Generation, GenerationConfig
from lmforge.inference.engine import Request as EngineRequest
from lmforge.serve.limits import BodyLimits
from lmforge.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Sampling,
    TokenizeRequest,
    chat_logprobs,
    completion_logprobs,
    validation_error,
)
from lmforge.serve.worker import EngineWorker, QueueFull, Ticket

STATIC = Path(__file__).parent / "static"
log = logging.getLogger("lmforge.serve")


@dataclass
class Served:
    """What the routes need to know about the model behind the worker."""

    worker: EngineWorker
    tokenizer: Tokenizer
    name: str
    max_len: int  # the model's context, prompt + completion
    vocab_size: int
    api_key: str | None = None  # None: no key; an empty one is refused (it would let in an empty Bearer key)
    max_body_bytes: int = 2 * 2**20
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give a key, or None to serve without one")
        self.max_text_chars = max_text_chars(self.tokenizer, self.max_len)

    def check_chars(self, chars: int, param: str) -> None:
        """Refuse a text that cannot fit the context, before the work of tokenizing it."""
        if chars > self.max_text_chars:
            raise APIError(400, f"{_the(param)} {chars} characters, more than this model's context of {self.max_len} "
                                f"tokens can hold (at most {self.max_text_chars}): shorten the {param}",
                           param=param, code="context_length_exceeded")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.name!r} (GET /v1/models)",
                           param="model", code="model_not_found")

    def check_length(self, prompt: list[int], max_tokens: int, param: str) -> None:
        if len(prompt) + max_tokens > self.max_len:
            raise APIError(400, f"this model's context is {self.max_len} tokens; {_the(param)} {len(prompt)} and "
                                f"max_tokens asks for {max_tokens} more: shorten the {param} or lower max_tokens",
                           param=param if len(prompt) >= self.max_len else "max_tokens", code="context_length_exceeded")


def _the(param: str) -> str:
    """The request field as a message's subject, with its verb: "the prompt has", "the messages have"."""
    return f"the {param} {'have' if param == 'messages' else 'has'}"


def max_text_chars(tokenizer: Tokenizer, max_len: int) -> int:
    """The most characters a text that fits ``max_len`` tokens can have: a token (a byte-level
    BPE entry or a special token) spans at most as many characters as its vocabulary entry has."""
    return max_len * max(map(len, tokenizer.hf.get_vocab(with_added_tokens=True)))


def create_app(served: Served) -> FastAPI:
    """The FastAPI application over ``served.worker``; starting the app starts the worker."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        served.worker.start()
        yield
        served.worker.stop()

    app = FastAPI(title="lmforge", lifespan=lifespan)
    app.state.served = served
    app.add_middleware(BodyLimits, max_bytes=served.max_body_bytes, timeout_s=served.body_timeout_s)
    install_error_handlers(app)
    auth = [Depends(authorize(served))]

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": served.name, "pending": served.worker.pending, **served.worker.stats}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "lmforge",
                                             "max_model_len": served.max_len}]}

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatRequest):
        return await chat(served, body)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest):
        return await complete(served, body)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest) -> dict:
        served.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' (a text) or 'messages' (a conversation)", param="prompt")
        if body.messages is not None:
            tokens = await run_in_threadpool(chat_prompt, served, body.messages)
        else:
            tokens = await run_in_threadpool(text_tokens, served, body.prompt, body.add_special_tokens, "prompt")
        return {"count": len(tokens), "max_model_len": served.max_len, "tokens": tokens}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest) -> dict:
        served.check_model(body.model)

        def text() -> str:
            check_token_ids(served, body.tokens, "tokens")
            return served.tokenizer.decode(body.tokens)

        return {"prompt": await run_in_threadpool(text)}

    @app.get("/tokenizer_info", dependencies=auth)
    async def tokenizer_info() -> dict:
        config = served.tokenizer.config
        return {"bos_token": config["bos_token"], "eos_token": config["eos_token"], "pad_token": config["pad_token"],
                "chat_template": CHATML_TEMPLATE, "model_max_length": served.max_len}

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


# -------------------------------------------------------------------------- errors and the API key


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def install_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's JSON: a bad body is a 400 naming its field, an unknown route a 404."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail), code=None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


def authorize(served: Served):
    """A dependency that checks ``Authorization: Bearer <key>`` when the server has a key."""

    async def check(request: Request) -> None:
        if served.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), served.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                                "key the server was started with (--api-key)", code="invalid_api_key")

    return check


# -------------------------------------------------------------------------- prompts


def checked_messages(messages: list) -> list[dict]:
    conversation = [m.model_dump() for m in messages]
    try:
        validate_messages(conversation, need_assistant=False)
    except ExampleError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    return conversation


def chat_prompt(served: Served, messages: list) -> list[int]:
    """The ChatML prompt's token ids of a conversation that can fit the context (on a worker
    thread): its rendered text is measured first (many short turns render long)."""
    served.check_chars(sum(len(m.content) for m in messages), "messages")
    conversation = checked_messages(messages)
    served.check_chars(sum(len(text) for text, _ in render_chatml(conversation, add_generation_prompt=True)), "messages")
    return chat_prompt_ids(served.tokenizer, conversation)


def text_tokens(served: Served, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """A text's token ids (BOS first with ``add_special_tokens``), if it can fit the context.
    ``encode_batch`` lets go of the interpreter lock while it runs, as ``encode`` does not."""
    served.check_chars(len(text), param)
    return ([served.tokenizer.bos_id] if add_special_tokens else []) + served.tokenizer.encode_batch([text])[0]


def check_token_ids(served: Served, tokens: list[int], param: str) -> None:
    bad = [t for t in tokens if not 0 <= t < served.vocab_size]
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {served.vocab_size})", param=param)


def completion_prompts(served: Served, body: CompletionRequest) -> list[tuple[str, list[int]]]:
    """Each prompt of a completion request as (its text, its token ids); on a worker thread."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty: give a text, a list of texts, token ids or a list of token-id lists",
                       param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    if len(prompt) * body.n > served.worker.max_pending:
        raise APIError(400, f"{len(prompt)} prompts x n = {body.n} is more than this server holds at once "
                            f"(max_pending {served.worker.max_pending}): send fewer at a time", param="prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append((p, text_tokens(served, p, body.add_special_tokens, "prompt")))
        else:
            if not p:
                raise APIError(400, "a token-id prompt needs at least one token", param="prompt")
            served.check_length(p, max(body.max_tokens, 1), "prompt")  # before looking at every id of a long list
            check_token_ids(served, p, "prompt")
            out.append((served.tokenizer.decode(p), list(p)))
    return out


def generation_config(body: Sampling, max_tokens: int, stop_ids: list[int] | None, top: int,
                      prompt_logprobs: bool = False) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                            stop=body.stops(), stop_token_ids=[] if body.ignore_eos else stop_ids, seed=body.seed,
                            n=body.n, top_logprobs=top, prompt_logprobs=prompt_logprobs)


def check_n(served: Served, n: int) -> None:
    if n > served.worker.engine.max_batch:
        raise APIError(400, f"n = {n} is more than the server's batch ({served.worker.engine.max_batch} rows)", param="n")


# -------------------------------------------------------------------------- the engine, from a handler


def submit(served: Served, requests: list[EngineRequest], stream: bool) -> tuple[list[Ticket], asyncio.Queue]:
    """Submit requests whose events share one queue, each tagged with its index."""
    events: asyncio.Queue = asyncio.Queue()
    tickets: list[Ticket] = []
    try:
        for tag, request in enumerate(requests):
            tickets.append(served.worker.submit(request, events, tag, stream))
    except QueueFull as exc:
        for ticket in tickets:
            served.worker.cancel(ticket)
        raise APIError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded") from exc
    return tickets, events


def event_error(exc: BaseException) -> APIError:
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")


async def results(served: Served, requests: list[EngineRequest]) -> list[list[Generation]]:
    """Every request's generations, once all have finished."""
    tickets, events = submit(served, requests, stream=False)
    out: list[list[Generation] | None] = [None] * len(tickets)
    try:
        while any(r is None for r in out):
            tag, kind, *payload = await events.get()
            if kind == "error":
                raise event_error(payload[0])
            if kind == "done":
                out[tag] = payload[0]
    finally:
        for ticket in tickets:
            served.worker.cancel(ticket)  # a no-op for finished ones
    return out


def completion_tokens(g: Generation) -> int:
    return len(g.tokens) + (g.stop_token is not None)


def usage(prompt_tokens: int, generations: list[Generation]) -> dict:
    completion = sum(completion_tokens(g) for g in generations)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


class TextDelta:
    """The text a stream may send after each token: what is certain (no stop string could still
    begin in it, no character half-decoded); the rest is sent when the generation finishes."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.tokenizer, self.tokens, self.sent = tokenizer, [], 0
        self.hold = max((len(s) for s in stops), default=1) - 1

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        end = len(text) - self.hold
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent : end], end
        return piece

    def finish(self, text: str) -> str:
        piece, self.sent = text[self.sent :], len(text)
        return piece


async def sse(served: Served, tickets: list[Ticket], events: asyncio.Queue, chunks) -> AsyncIterator[str]:
    """Server-sent events from ``chunks(event)`` (each a list of OpenAI chunk dicts) until every
    request is done, then ``[DONE]``; a client that leaves cancels what is still decoding. A
    failure (the engine's error event, or one here) is sent as OpenAI's error object, then
    ``[DONE]``: the client learns why, and the connection ends as a stream does."""
    remaining = len(tickets)
    try:
        for chunk in chunks(None):
            yield json.dumps(chunk)
        while remaining:
            event = await events.get()
            if event[1] == "error":
                raise event[2]
            remaining -= event[1] == "done"
            for chunk in chunks(event):
                yield json.dumps(chunk)
    except Exception as exc:  # noqa: BLE001 - a leaving client is GeneratorExit or CancelledError, not caught
        if not isinstance(exc, ValueError):
            log.error("a stream failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        yield json.dumps((exc if isinstance(exc, APIError) else event_error(exc)).body())
    finally:
        for ticket in tickets:
            served.worker.cancel(ticket)
    yield "[DONE]"


# -------------------------------------------------------------------------- chat completions


def chat_end(tokenizer: Tokenizer) -> int:
    """The id of ``<|im_end|>``, which ends the assistant's turn."""
    try:
        return tokenizer.token_to_id(IM_END)
    except InputError as exc:
        raise APIError(400, f"this model's tokenizer has no {IM_END}, so it has no chat template (a base model, not "
                            "a fine-tuned one): use /v1/completions", param="messages") from exc


async def chat(served: Served, body: ChatRequest):
    served.check_model(body.model)
    check_n(served, body.n)
    tok = served.tokenizer
    prompt = await run_in_threadpool(chat_prompt, served, body.messages)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = max(served.max_len - len(prompt), 1)  # as much as the context leaves
    if max_tokens < 1:
        raise APIError(400, "max_tokens must be at least 1 for a chat completion", param="max_tokens")
    served.check_length(prompt, max_tokens, "messages")
    top = (body.top_logprobs or 0) if body.logprobs else 0
    request = EngineRequest(prompt, generation_config(body, max_tokens, [chat_end(tok), tok.eos_id], top))
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": served.name}

    if body.stream:
        tickets, events = submit(served, [request], stream=True)
        deltas = [TextDelta(tok, body.stops()) for _ in range(body.n)]
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def chunk(index: int, delta: dict, logprobs=None, finish=None) -> dict:
            return {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

        def chunks(event) -> list[dict]:
            if event is None:
                return [chunk(i, {"role": "assistant", "content": ""}) for i in range(body.n)]
            if event[1] == "token":
                _, _, sample, token, logprob, alts = event
                piece = deltas[sample].add(token)
                logprobs = {"content": chat_logprobs(tok, [token], [logprob], [alts])} if body.logprobs else None
                return [chunk(sample, {"content": piece}, logprobs)] if piece or logprobs else []
            generations = event[2]
            out = []
            for i, g in enumerate(generations):
                piece = deltas[i].finish(g.text)
                out.append(chunk(i, {"content": piece} if piece else {}, finish=g.finish_reason))
            if include_usage:
                out.append({**head, "object": "chat.completion.chunk", "choices": [],
                            "usage": usage(len(prompt), generations)})
            return out

        return EventSourceResponse(sse(served, tickets, events, chunks))

    (generations,) = await results(served, [request])
    choices = [{"index": i, "message": {"role": "assistant", "content": g.text},
                "logprobs": {"content": chat_logprobs(tok, g.tokens, g.logprobs, g.top_logprobs or [None] * len(g.tokens))}
                if body.logprobs else None,
                "finish_reason": g.finish_reason} for i, g in enumerate(generations)]
    return {**head, "object": "chat.completion", "choices": choices, "usage": usage(len(prompt), generations)}


# -------------------------------------------------------------------------- completions


def completion_choice_logprobs(served: Served, prompt: list[int], g: Generation, body: CompletionRequest) -> dict:
    """The ``logprobs`` of one choice: the echoed prompt's (its first token has none), the
    generated tokens', and the stop token's that ended it."""
    k = body.logprobs or 0
    tokens, logprobs, tops = [], [], []
    if body.echo:
        tokens += prompt
        logprobs += [None, *g.prompt_logprobs]
        tops += [None, *(g.prompt_top_logprobs or [None] * len(g.prompt_logprobs))]
    if body.max_tokens > 0:
        tokens += g.tokens
        logprobs += g.logprobs
        tops += g.top_logprobs or [None] * len(g.tokens)
        if g.stop_token is not None:
            token, logprob, alts = g.stop_token
            tokens, logprobs, tops = tokens + [token], logprobs + [logprob], tops + [alts]
    return completion_logprobs(served.tokenizer, tokens, logprobs, tops, k)


async def complete(served: Served, body: CompletionRequest):
    served.check_model(body.model)
    check_n(served, body.n)
    prompts = await run_in_threadpool(completion_prompts, served, body)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens 0 generates nothing: it is for scoring a prompt, with echo: true and logprobs",
                       param="max_tokens")
    if body.max_tokens == 0 and body.stream:
        raise APIError(400, "max_tokens 0 (scoring the prompt) cannot stream", param="stream")
    # max_tokens 0 scores the prompt: the engine chooses one token from the prefill's logits
    # (no further forward), and the answer leaves it out.
    max_new = max(body.max_tokens, 1)
    for _, ids in prompts:
        served.check_length(ids, max_new, "prompt")
    k = body.logprobs or 0
    scored = body.echo and body.logprobs is not None
    config = generation_config(body, max_new, None, k, prompt_logprobs=scored)
    requests = [EngineRequest(ids, config) for _, ids in prompts]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": served.name}
    n = body.n

    if body.stream:
        tickets, events = submit(served, requests, stream=True)
        deltas = [[TextDelta(served.tokenizer, body.stops()) for _ in range(n)] for _ in prompts]

        def chunk(index: int, text: str, logprobs=None, finish=None) -> dict:
            return {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

        def chunks(event) -> list[dict]:
            if event is None:
                return [chunk(p * n + s, text) for p, (text, _) in enumerate(prompts) for s in range(n)] if body.echo else []
            tag = event[0]
            if event[1] == "token":
                _, _, sample, token, logprob, alts = event
                piece = deltas[tag][sample].add(token)
                logprobs = completion_logprobs(served.tokenizer, [token], [logprob], [alts], k) \
                    if body.logprobs is not None else None
                return [chunk(tag * n + sample, piece, logprobs)] if piece or logprobs else []
            return [chunk(tag * n + i, deltas[tag][i].finish(g.text), finish=g.finish_reason)
                    for i, g in enumerate(event[2])]

        return EventSourceResponse(sse(served, tickets, events, chunks))

    choices, all_generations = [], []
    for p, ((text, ids), generations) in enumerate(zip(prompts, await results(served, requests))):
        for s, g in enumerate(generations):
            generated = g.text if body.max_tokens > 0 else ""
            finish = g.finish_reason if body.max_tokens > 0 else "length"
            choice = {"index": p * n + s, "text": (text if body.echo else "") + generated, "logprobs": None,
                      "finish_reason": finish}
            if body.logprobs is not None:
                choice["logprobs"] = completion_choice_logprobs(served, ids, g, body)
            choices.append(choice)
            all_generations.append(g if body.max_tokens > 0 else Generation(g.prompt_tokens, [], "length"))
    return {**head, "choices": choices, "usage": usage(sum(len(ids) for _, ids in prompts), all_generations)}
