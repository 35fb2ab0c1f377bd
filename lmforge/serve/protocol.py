"""The OpenAI API's request bodies, its errors, and its log-probability formats.

Bodies are pydantic models in strict mode (a string where a number belongs is an error, not
a conversion); fields the API has and lmforge does not use are accepted and ignored, as
clients send them (``user``, zero penalties). vLLM's extra ``ignore_eos`` and
``add_special_tokens`` are understood. A ``seed`` must be one torch's generator takes, in
[-2^63, 2^64 - 1], and a ``stop`` string must not be empty (it would match at once): else a 400
naming the field, before the request goes near the batch. Every error is OpenAI's JSON,
``{"error": {"message", "type", "param", "code"}}``, with an HTTP status of 4xx for the
client's mistakes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lmforge.data.tokenizer import Tokenizer
from lmforge.inference.engine import SEED_RANGE


class APIError(Exception):
    """An error answered as OpenAI's error object with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


NonNegative = Annotated[int, Field(ge=0)]
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
StopString = Annotated[str, Field(min_length=1)]
Stop = StopString | Annotated[list[StopString], Field(max_length=4)] | None
Seed = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]
MAX_TURNS = 4096  # a conversation's turns: each is 5 tokens or more; pydantic refuses more before validating them


class StreamOptions(Body):
    include_usage: bool = False


class Sampling(Body):
    """What both endpoints share."""

    model: str
    n: Annotated[int, Field(ge=1, le=64)] = 1
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stop: Stop = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's: generate max_tokens tokens, whatever the model says
    presence_penalty: Annotated[float, Field(ge=0, le=0)] = 0.0  # accepted at 0 only: not implemented
    frequency_penalty: Annotated[float, Field(ge=0, le=0)] = 0.0

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class Message(Body):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_TURNS)]
    max_tokens: NonNegative | None = None
    max_completion_tokens: NonNegative | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: NonNegative = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_special_tokens: bool = True  # a text prompt starts with BOS, as documents did in pre-training


class TokenizeRequest(Body):
    """vLLM's ``/tokenize``: a text, or a conversation (ChatML up to the assistant's turn)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Field(max_length=MAX_TURNS)] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[NonNegative]


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """pydantic's first complaint about a body as a 400 naming the parameter."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                        code="invalid_json")
    if not loc:
        return APIError(400, f"the body must be a JSON object of the request's parameters: {first['msg']}",
                        code="invalid_value")
    return APIError(400, f"{'.'.join(loc)}: {first['msg']}", param=loc[0], code="invalid_value")


# -------------------------------------------------------------------------- log-probabilities


def token_text(tokenizer: Tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def alternatives(tokenizer: Tokenizer, top: list[tuple[int, float]] | None, chosen: tuple[int, float] | None = None
                 ) -> dict[str, float]:
    """The completions API's ``{token text: logprob}`` of the alternatives (and, as vLLM does, the
    chosen token); tokens that read the same keep the highest log-probability."""
    out: dict[str, float] = {}
    for token, logprob in [*(top or []), *([chosen] if chosen else [])]:
        text = token_text(tokenizer, token)
        out[text] = max(out.get(text, float("-inf")), logprob)
    return out


def completion_logprobs(tokenizer: Tokenizer, tokens: list[int], logprobs: list[float | None],
                        tops: list[list[tuple[int, float]] | None], k: int) -> dict:
    """The completions API's ``logprobs`` object: tokens, their log-probabilities (None for an
    echoed first token, which nothing predicts), the ``k`` alternatives and character offsets."""
    texts = [token_text(tokenizer, t) for t in tokens]
    offsets, position = [], 0
    for text in texts:
        offsets.append(position)
        position += len(text)
    top = [None if lp is None else alternatives(tokenizer, alts[:k] if alts else None, (t, lp))
           for t, lp, alts in zip(tokens, logprobs, tops)]
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, tokens: list[int], logprobs: list[float],
                  tops: list[list[tuple[int, float]] | None]) -> list[dict]:
    """The chat API's ``logprobs.content`` entries."""
    def entry(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts or []]}
            for t, lp, alts in zip(tokens, logprobs, tops)]
