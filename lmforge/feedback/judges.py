"""Critics and judges: who writes critiques and revisions, and who answers a comparison.

A ``Judge`` does two things, each over a batch of items (so the engine batches them and an
endpoint takes them in parallel):

- ``generate(chats)``: the text of its answer to each chat (critic: critiques, revisions);
- ``compare(comparisons)``: its ``Answer`` to each multiple-choice question over responses (A)
  and (B) (``comparison_messages``): greedy, with each answer token's ``top_logprobs`` most
  likely alternatives, from which ``labels.choice_probability`` reads the soft label.

Three backends, chosen by which of ``checkpoint``, ``base_url`` or ``function`` the config sets:

- ``CheckpointJudge``: an lmforge checkpoint in this process, through the inference engine,
  with the chat rendered as ``lmforge sft`` trained on it (ChatML, ``data.chat``);
- ``EndpointJudge``: any OpenAI-compatible ``/chat/completions`` endpoint (``lmforge serve``,
  vLLM, a hosted model), with the API key read from the environment variable ``api_key_env``,
  a deadline per request (``timeout_s`` from connecting to the last byte, so a server that
  trickles its reply cannot hold a request longer), retries with exponential backoff on
  timeouts, connection errors, replies cut short, HTTP 429 and 5xx,
  ``concurrency`` requests in flight, and a cache on disk: one JSON file per request, named by
  the SHA-256 of the URL and the request body and written atomically, so a rerun sends nothing
  already answered (and a run stopped by an error keeps what was answered before it);
- ``CallableJudge``: a Python function ``module:function`` (a plugin: its module is imported
  when the stage starts, not when the recipe is read) called with each ``Chat`` (return the
  text) or ``Comparison`` (return the probability that (A) is the better response, or a text
  naming (A) or (B)): rules, tests, a custom scorer. One that raises is an error naming the
  function and the item.

``lmforge serve`` answers ``/chat/completions`` with the engine's own log-probs (the chat API's
``logprobs.content[i].top_logprobs``), so a checkpoint served and the same checkpoint in
process give the same answers and the same soft labels (``tests/feedback/test_endpoint.py``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import http.client
import io
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch

from lmforge.checkpoints.device import resolve_device
from lmforge.checkpoints.load import load_model
from lmforge.core.config import (
    ConfigError,
    at_least,
    in_range,
    load_plugin,
    option,
    plugin_field,
    positive,
    seed_field,
    unit_interval,
)
from lmforge.core.io import InputError, atomic_write_json
from lmforge.data.chat import chat_prompt_ids
from lmforge.data.chatml import IM_END
from lmforge.data.tokenizer import Tokenizer
from lmforge.inference.engine import Engine, GenerationConfig, Request

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class JudgeError(InputError):
    """A judge that could not answer an item (the message names it): refused, timed out, malformed."""


class JudgeRefused(JudgeError):
    """The judge declined to answer (an HTTP 4xx, a ``refusal``, a content filter)."""


JUDGE_KEYS = {"checkpoint": "checkpoint", "endpoint": "base_url", "callable": "function"}  # kind -> its judge.* key


@dataclass
class JudgeConfig:
    """The critic or judge: exactly one of ``checkpoint``, ``base_url`` (with ``model``) or ``function``."""

    checkpoint: str | None = option(None, help="an lmforge checkpoint or run directory, run in this process")
    base_url: str | None = option(None, help="an OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1")
    model: str | None = option(None, help="the endpoint's model name")
    api_key_env: str | None = option(
        "OPENAI_API_KEY", help="the environment variable holding the key; unset or null: none sent"
    )
    function: str | None = plugin_field(help="module:function, imported at stage start")
    max_new_tokens: int = positive(128, help="critiques and revisions")
    temperature: float = at_least(0, 0.0, help="critiques and revisions; comparisons are always greedy")
    top_p: float = unit_interval(1.0, low_open=True, help="nucleus sampling of critiques and revisions; 1 = off")
    seed: int = seed_field(0, help="with the item's key, the seed of each sampled critique or revision")
    answer_tokens: int = positive(8, help='the length of a comparison\'s answer: "(A)" and a little room')
    top_logprobs: int = in_range(20, 1, 20, help="alternatives per answer token (OpenAI's API allows at most 20)")
    logprobs: bool = option(True, help="ask the endpoint for log-probs (false: a parsed choice, for APIs without them)")
    max_batch: int = positive(32, help="checkpoint: rows decoding together")
    dtype: Literal["float32", "bfloat16"] = option("float32", help="checkpoint")
    device: str = option("auto", help="checkpoint: auto = cuda when available, else cpu")
    timeout_s: float = positive(120.0, help="endpoint: per request, from connecting to the reply's last byte")
    max_retries: int = at_least(
        0, 4, help="endpoint: after the first try, on timeouts, connection errors, cut replies, 429, 5xx"
    )
    backoff_s: float = at_least(0, 1.0, help="endpoint: the first retry waits this, each next one twice as long")
    concurrency: int = positive(4, help="endpoint: requests in flight")
    cache: bool = option(True, help="endpoint: keep every answer on disk (run_dir/judge-cache) and reuse it")

    def kind(self) -> Literal["checkpoint", "endpoint", "callable"]:
        given = {"checkpoint": self.checkpoint, "endpoint": self.base_url, "callable": self.function}
        chosen = [k for k, v in given.items() if v]
        if len(chosen) != 1:
            raise ConfigError("the judge needs exactly one of judge.checkpoint (an lmforge checkpoint), judge.base_url "
                              "(an OpenAI-compatible API, with judge.model) or judge.function (module:function); got "
                              + (", ".join(f"judge.{JUDGE_KEYS[k]}" for k in chosen) or "none")
                              + " (to switch from a checkpoint, also set judge.checkpoint=null)")
        if chosen[0] == "endpoint" and not self.model:
            raise ConfigError("judge.base_url needs judge.model, the endpoint's model name (its /v1/models lists them)")
        return chosen[0]  # type: ignore[return-value]

    def fingerprint(self) -> dict:
        """What the judge's answers depend on (not how they are fetched: timeouts, retries, batching)."""
        keep = ("checkpoint", "base_url", "model", "function", "max_new_tokens", "temperature", "top_p", "seed",
                "answer_tokens", "top_logprobs", "logprobs", "dtype")
        return {k: getattr(self, k) for k in keep}


@dataclass(frozen=True)
class Chat:
    """A conversation for the critic to continue; ``key`` names the item (errors, seeds, the trace)."""

    key: str
    messages: list[dict]


@dataclass(frozen=True)
class Comparison:
    """A comparison question over responses ``a`` (option (A)) and ``b`` (option (B)) to ``prompt``."""

    key: str
    prompt: str | list[dict]  # the conversation the responses answer (plain text: one user turn)
    a: str
    b: str
    question: str  # the principle's comparison question

    @property
    def messages(self) -> list[dict]:
        return comparison_messages(self)


@dataclass
class TokenChoice:
    """One answer token as text, its log-prob, and the most likely alternatives at its position."""

    text: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Answer:
    """A judge's answer to a comparison: its text, its tokens when the backend gave log-probs,
    or a callable's own probability of (A)."""

    text: str
    tokens: list[TokenChoice] | None = None
    p_a: float | None = None


class Judge(Protocol):
    def generate(self, chats: Sequence[Chat]) -> list[str]: ...

    def compare(self, comparisons: Sequence[Comparison]) -> list[Answer]: ...


def conversation_text(prompt: str | list[dict]) -> str:
    """The conversation as plain lines (``User: ...``), as the paper shows it to the judge."""
    if isinstance(prompt, str):
        return f"User: {prompt}"
    return "\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in prompt)


def comparison_messages(c: Comparison) -> list[dict]:
    """The RL-CAI multiple-choice prompt (Bai et al. 2022, section 4.1) as one user turn."""
    text = (f"Consider the following conversation between a user and an assistant.\n\n"
            f"{conversation_text(c.prompt)}\n\n{c.question}\n\nOptions:\n(A) {c.a}\n(B) {c.b}\n\n"
            f"Answer with (A) or (B) only.")
    return [{"role": "user", "content": text}]


def item_seed(seed: int, key: str) -> int:
    """A seed for one item: a hash of the recipe's seed and the item's key, so an item gets the
    same critique whatever else shares its batch and however the run was interrupted."""
    digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    return int(np.frombuffer(digest[:8], dtype=np.uint64)[0] >> np.uint64(1))


# --------------------------------------------------------------------------- in process


class CheckpointJudge:
    """An lmforge checkpoint, through the engine, on ChatML prompts."""

    def __init__(self, cfg: JudgeConfig):
        self.cfg = cfg
        device = resolve_device(cfg.device)
        model, directory = load_model(cfg.checkpoint, device=device)
        self.model = model.to(DTYPES[cfg.dtype]).eval()
        self.tok = Tokenizer.load(directory)
        self.stop_ids = [self.tok.token_to_id(IM_END), self.tok.eos_id]

    def run(self, items: Sequence[Chat | Comparison], config: GenerationConfig, sampled: bool) -> list:
        engine = Engine(self.model, self.tok, max_batch=self.cfg.max_batch)
        device = self.model.embed.weight.device
        ids = []
        for item in items:
            generator = torch.Generator(device).manual_seed(item_seed(self.cfg.seed, item.key)) if sampled else None
            try:
                ids.append(engine.submit(Request(chat_prompt_ids(self.tok, item.messages), config, generator)))
            except ValueError as exc:  # the prompt does not fit the judge's context
                raise JudgeError(f"{item.key}: the judge's prompt does not fit {self.cfg.checkpoint}: {exc}") from exc
        with torch.no_grad():
            finished = dict(engine.run())
        return [finished[i][0] for i in ids]

    def generate(self, chats: Sequence[Chat]) -> list[str]:
        cfg = self.cfg
        config = GenerationConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                  stop_token_ids=self.stop_ids)
        return [g.text or "" for g in self.run(chats, config, sampled=cfg.temperature > 0)]

    def compare(self, comparisons: Sequence[Comparison]) -> list[Answer]:
        config = GenerationConfig(max_new_tokens=self.cfg.answer_tokens, temperature=0.0, stop_token_ids=self.stop_ids,
                                  top_logprobs=self.cfg.top_logprobs)

        def text(token: int) -> str:  # as `lmforge serve` names a token in its logprobs
            return self.tok.decode([token])

        out = []
        for g in self.run(comparisons, config, sampled=False):
            tokens = [TokenChoice(text(t), lp, [(text(a), alp) for a, alp in top])
                      for t, lp, top in zip(g.tokens, g.logprobs, g.top_logprobs or [[]] * len(g.tokens))]
            out.append(Answer(g.text or "", tokens))
        return out


# --------------------------------------------------------------------------- an OpenAI-compatible endpoint


RETRIED_STATUS = {408, 409, 429, 500, 502, 503, 504}


class DeadlineSocket:
    """A connected socket whose every send and receive waits at most until ``deadline``
    (``time.monotonic``): a socket timeout alone bounds each read, so a server sending a byte
    a second would hold a request for as long as it likes. As with ``socket.makefile``, closing
    it while a reader is open (urllib does, once the headers are read) closes it with the reader."""

    def __init__(self, sock, deadline: float):
        self.sock, self.deadline = sock, deadline
        self.readers, self.closing = 0, False

    def arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self.sock.settimeout(left)

    def sendall(self, data, *flags) -> None:
        self.arm()
        self.sock.sendall(data, *flags)

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        self.arm()
        return self.sock.recv_into(buffer, nbytes, flags)

    def makefile(self, mode: str = "rb", *args, **kwargs) -> io.BufferedReader:  # http.client reads the reply here
        self.readers += 1
        return io.BufferedReader(DeadlineReader(self))

    def release(self) -> None:
        self.readers -= 1
        if self.closing and not self.readers:
            self.sock.close()

    def close(self) -> None:
        self.closing = True
        if not self.readers:
            self.sock.close()

    def __getattr__(self, name: str):  # fileno, setsockopt, shutdown...
        return getattr(self.sock, name)


class DeadlineReader(io.RawIOBase):
    def __init__(self, sock: DeadlineSocket):
        self.sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self.sock.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            self.sock.release()
        super().close()


class DeadlineConnection:
    """For an ``http.client`` connection class: once connected (TLS included), its socket keeps ``deadline``."""

    def __init__(self, *args, deadline: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self) -> None:
        super().connect()
        self.sock = DeadlineSocket(self.sock, self.deadline)


class DeadlineHTTPConnection(DeadlineConnection, http.client.HTTPConnection):
    pass


class DeadlineHTTPSConnection(DeadlineConnection, http.client.HTTPSConnection):
    pass


class DeadlineHandler:
    """For a ``urllib`` handler: its connections keep ``deadline`` (proxies and the rest of urllib unchanged)."""

    CONNECTIONS = {http.client.HTTPConnection: DeadlineHTTPConnection,
                   http.client.HTTPSConnection: DeadlineHTTPSConnection}

    def __init__(self, deadline: float):
        super().__init__()
        self.deadline = deadline

    def do_open(self, http_class, req, **kwargs):
        return super().do_open(functools.partial(self.CONNECTIONS[http_class], deadline=self.deadline), req, **kwargs)


class DeadlineHTTPHandler(DeadlineHandler, urllib.request.HTTPHandler):
    pass


class DeadlineHTTPSHandler(DeadlineHandler, urllib.request.HTTPSHandler):
    pass


def post_within(request: urllib.request.Request, timeout_s: float) -> bytes:
    """The body of the reply to ``request``, all of it within ``timeout_s`` seconds of now
    (``TimeoutError`` otherwise); HTTP errors raise ``urllib.error.HTTPError`` as ``urlopen`` does."""
    deadline = time.monotonic() + timeout_s
    opener = urllib.request.build_opener(DeadlineHTTPHandler(deadline), DeadlineHTTPSHandler(deadline))
    with opener.open(request, timeout=timeout_s) as response:
        return response.read()


class EndpointJudge:
    """An OpenAI-compatible ``/chat/completions`` endpoint (see the module docstring)."""

    def __init__(self, cfg: JudgeConfig, cache_dir: str | Path | None = None, sleep: Callable[[float], None] = time.sleep):
        self.cfg = cfg
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        self.api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        self.cache_dir = Path(cache_dir) if cache_dir is not None and cfg.cache else None
        self.sleep = sleep
        self.requests_sent = 0  # HTTP requests made, retries included (a rerun on a full cache makes none)

    def body(self, messages: list[dict], compare: bool, key: str) -> dict:
        cfg = self.cfg
        body: dict[str, Any] = {"model": cfg.model, "messages": messages}
        if compare:
            body.update(max_tokens=cfg.answer_tokens, temperature=0.0)
            if cfg.logprobs:
                body.update(logprobs=True, top_logprobs=cfg.top_logprobs)
        else:
            body.update(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                        seed=item_seed(cfg.seed, key) % 2**31)
        return body

    def cache_path(self, body: dict) -> Path | None:
        if self.cache_dir is None:
            return None
        digest = hashlib.sha256(json.dumps({"url": self.url, "body": body}, sort_keys=True).encode()).hexdigest()
        return self.cache_dir / digest[:2] / f"{digest}.json"

    def answer(self, key: str, body: dict) -> dict:
        """The endpoint's first choice for one request: from the cache, else from the endpoint (then cached)."""
        path = self.cache_path(body)
        if path is not None and path.is_file():
            try:
                return json.loads(path.read_text(encoding="utf-8"))["choice"]
            except (OSError, ValueError, KeyError):
                pass  # a damaged cache entry is asked again
        choice = self.checked_choice(key, self.post(key, body))
        if path is not None:
            atomic_write_json(path, {"request": body, "choice": choice})
        return choice

    def post(self, key: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        attempts = self.cfg.max_retries + 1
        for attempt in range(attempts):
            self.requests_sent += 1
            request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                raw = post_within(request, self.cfg.timeout_s)
                break
            except urllib.error.HTTPError as exc:
                message = error_message(exc)
                if exc.code not in RETRIED_STATUS:
                    hint = "" if self.api_key or exc.code not in (401, 403) else \
                        f" (no API key was sent: set ${self.cfg.api_key_env})" if self.cfg.api_key_env else \
                        " (no API key was sent: judge.api_key_env names the variable holding it)"
                    raise JudgeRefused(f"{key}: {self.url} refused the request: HTTP {exc.code}: {message}{hint}") \
                        from exc
                last = f"HTTP {exc.code}: {message}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                reason = getattr(exc, "reason", exc)
                last = f"timed out after {self.cfg.timeout_s:g} s" if isinstance(reason, TimeoutError) \
                    else f"{type(reason).__name__}: {reason}"
            except http.client.HTTPException as exc:  # a reply cut short (IncompleteRead), a bad status line
                last = f"a broken HTTP reply: {exc!r}"
            if attempt + 1 < attempts:
                self.sleep(self.cfg.backoff_s * 2**attempt)
        else:
            raise JudgeError(f"{key}: {self.url} failed after {attempts} attempt(s): {last} (answers already judged are "
                             "kept; rerun to resume)")
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise JudgeError(f"{key}: {self.url} returned malformed JSON ({exc}): {raw[:200]!r}") from exc

    def checked_choice(self, key: str, reply: Any) -> dict:
        """The first choice's message text and log-probs, or a clear error for what is not a chat completion."""
        try:
            choice = reply["choices"][0]
            message = choice["message"]
            text = message.get("content")
        except (TypeError, KeyError, IndexError, AttributeError) as exc:
            raise JudgeError(f"{key}: {self.url} returned JSON that is not a chat completion (no "
                             f"choices[0].message): {json.dumps(reply)[:200]}") from exc
        if message.get("refusal") or choice.get("finish_reason") == "content_filter":
            raise JudgeRefused(f"{key}: the judge refused: {message.get('refusal') or 'content filter'}")
        if not isinstance(text, str):
            raise JudgeError(f"{key}: {self.url} returned a message without text content: {json.dumps(message)[:200]}")
        logprobs = choice.get("logprobs")
        return {"text": text, "logprobs": logprobs.get("content") if isinstance(logprobs, dict) else None}

    def map(self, items: Sequence[Chat | Comparison], compare: bool) -> list[dict]:
        bodies = [self.body(item.messages, compare, item.key) for item in items]
        failed = threading.Event()  # the first failure ends the batch: requests not yet sent never are

        def answer(key: str, body: dict) -> dict | None:
            if failed.is_set():
                return None
            try:
                return self.answer(key, body)
            except BaseException:
                failed.set()
                raise

        with concurrent.futures.ThreadPoolExecutor(self.cfg.concurrency) as pool:
            futures = [pool.submit(answer, item.key, body) for item, body in zip(items, bodies)]
            try:
                return [f.result() for f in futures]
            except BaseException:
                failed.set()
                raise

    def generate(self, chats: Sequence[Chat]) -> list[str]:
        return [choice["text"] for choice in self.map(chats, compare=False)]

    def compare(self, comparisons: Sequence[Comparison]) -> list[Answer]:
        out = []
        for item, choice in zip(comparisons, self.map(comparisons, compare=True)):
            tokens = None
            if choice["logprobs"]:
                try:
                    tokens = [TokenChoice(t["token"], float(t["logprob"]),
                                          [(a["token"], float(a["logprob"])) for a in t.get("top_logprobs") or []])
                              for t in choice["logprobs"]]
                except (TypeError, KeyError, ValueError) as exc:
                    raise JudgeError(f"{item.key}: {self.url} returned malformed logprobs: "
                                     f"{json.dumps(choice['logprobs'])[:200]}") from exc
            out.append(Answer(choice["text"], tokens))
        return out


def error_message(exc: urllib.error.HTTPError) -> str:
    """The API's ``error.message`` of an HTTP error, else the start of its body."""
    try:
        raw = exc.read()
    except (OSError, http.client.HTTPException):
        return str(exc.reason)
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace") or str(exc.reason)


# --------------------------------------------------------------------------- a Python callable


def import_function(spec: str) -> Callable:
    """The function ``spec`` (module:function) names: a plugin, imported only when the stage starts."""
    return load_plugin(spec, "judge.function", "mypackage.rules:judge")


class CallableJudge:
    """``fn(Chat) -> str`` for critiques and revisions; ``fn(Comparison) -> float | str`` for
    comparisons: the probability that (A) is better, or a text naming (A) or (B)."""

    def __init__(self, cfg: JudgeConfig):
        self.spec, self.fn = cfg.function, import_function(cfg.function)

    def call(self, item: Chat | Comparison):
        """``fn(item)``; raising is an error naming the function and the item."""
        try:
            return self.fn(item)
        except Exception as exc:
            raise JudgeError(f"{item.key}: the judge function {self.spec} raised {exc!r}") from exc

    def generate(self, chats: Sequence[Chat]) -> list[str]:
        out = []
        for chat in chats:
            text = self.call(chat)
            if not isinstance(text, str):
                raise JudgeError(f"{chat.key}: {self.spec} returned {type(text).__name__} for a chat, not a text")
            out.append(text)
        return out

    def compare(self, comparisons: Sequence[Comparison]) -> list[Answer]:
        out = []
        for c in comparisons:
            value = self.call(c)
            if isinstance(value, str):
                out.append(Answer(value))
            elif isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= 1.0:
                out.append(Answer(f"P(A) = {value}", p_a=float(value)))
            else:
                raise JudgeError(f"{c.key}: {self.spec} returned {value!r} for a comparison: return the probability "
                                 "that (A) is better (a number in [0, 1]) or a text naming (A) or (B)")
        return out


def build_judge(cfg: JudgeConfig, cache_dir: str | Path | None = None) -> Judge:
    """The judge ``cfg`` names; an endpoint caches its answers under ``cache_dir``."""
    kind = cfg.kind()
    if kind == "checkpoint":
        return CheckpointJudge(cfg)
    if kind == "endpoint":
        return EndpointJudge(cfg, cache_dir)
    return CallableJudge(cfg)
