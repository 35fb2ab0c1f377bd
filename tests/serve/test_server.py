"""`lmforge serve` through the official openai client: every answer equals what the engine and
the model's forward give in process, streams join to the same text, bad requests get
OpenAI's JSON errors and the server keeps serving, limits and the API key hold."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import requests
import torch

from lmforge.checkpoints.load import load_model
from lmforge.data.chat import chat_prompt_ids
from lmforge.data.chatml import IM_END
from lmforge.data.tokenizer import Tokenizer
from lmforge.inference.engine import GenerationConfig, generate
from tests.conftest import REPO
from tests.serve.conftest import MODEL_NAME, start_server

CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the king doing?"}]


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The same checkpoint loaded apart from the server's: what the answers must equal."""
    model, _ = load_model(str(checkpoint), device="cpu")
    return model.eval(), Tokenizer.load(checkpoint)


def engine_answer(reference, prompt: list[int], **config) -> list:
    model, tok = reference
    return generate(model, [prompt], GenerationConfig(**config), tok)


def forward_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[t] | tokens[:t]) for t >= 1, from one forward."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]))[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)


def sse_lines(url: str, body: dict, headers: dict | None = None) -> list[str]:
    """The data lines of a streamed answer, as sent."""
    with requests.post(url, json=body, headers=headers, timeout=60, stream=True) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: "):] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]


# -------------------------------------------------------------------------- models, chat


def test_models_lists_the_served_model_with_its_context(client):
    (model,) = client.models.list().data
    assert model.id == MODEL_NAME and model.owned_by == "lmforge" and model.model_extra["max_model_len"] == 1024


def test_a_chat_completion_is_the_engines_answer_to_the_chatml_prompt(client, reference):
    model, tok = reference
    answer = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0)
    prompt = chat_prompt_ids(tok, CHAT)
    (expected,) = engine_answer(reference, prompt, max_new_tokens=12, temperature=0.0,
                                stop_token_ids=[tok.token_to_id(IM_END), tok.eos_id])
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason == "length"
    assert answer.usage.prompt_tokens == len(prompt) and answer.usage.completion_tokens == 12
    assert answer.usage.total_tokens == len(prompt) + 12 and answer.object == "chat.completion"


def test_a_stop_string_ends_the_answer_with_finish_reason_stop(client):
    free = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0).choices[0]
    stop = free.message.content[5:8]
    cut = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0,
                                         stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == free.message.content[: free.message.content.find(stop)]
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0,
                                                 stop=[stop], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut.message.content  # nothing past the stop
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_streaming_sends_the_same_text_in_chunks_then_usage_and_done(client, server):
    base = dict(model=MODEL_NAME, messages=CHAT, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**base).choices[0]
    chunks = list(client.chat.completions.create(**base, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # it did stream
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    raw = sse_lines(server[0].url + "/v1/chat/completions", {**base, "stream": True})
    assert raw[-1] == "[DONE]" and json.loads(raw[0])["object"] == "chat.completion.chunk"


def test_chat_logprobs_equal_the_models_forward(client, reference):
    model, tok = reference
    answer = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3)
    prompt = chat_prompt_ids(tok, CHAT)
    (expected,) = engine_answer(reference, prompt, max_new_tokens=6, temperature=0.0)
    content = answer.choices[0].logprobs.content
    want = forward_logprobs(model, prompt + expected.tokens)[len(prompt) - 1 :]
    torch.testing.assert_close(torch.tensor([c.logprob for c in content]), want, atol=1e-4, rtol=0)
    for c, token in zip(content, expected.tokens):
        assert c.token == tok.decode([token]) and bytes(c.bytes) == c.token.encode()
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)  # greedy: the top one


def test_n_samples_with_a_seed_are_reproducible_and_differ_between_seeds(client):
    def samples(seed: int) -> list[str]:
        answer = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=1.0,
                                                top_p=0.9, n=3, seed=seed)
        assert [c.index for c in answer.choices] == [0, 1, 2] and answer.usage.completion_tokens == 30
        return [c.message.content for c in answer.choices]

    assert samples(7) == samples(7)
    assert samples(7) != samples(8)


# -------------------------------------------------------------------------- completions


def test_completions_of_text_and_token_id_prompts_are_the_engines(client, reference):
    model, tok = reference
    text = "To be, or not"
    answer = client.completions.create(model=MODEL_NAME, prompt=[text, "The king"], max_tokens=8, temperature=0)
    for choice, p in zip(answer.choices, [text, "The king"]):
        (expected,) = engine_answer(reference, [tok.bos_id, *tok.encode(p)], max_new_tokens=8, temperature=0.0)
        assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    assert [c.index for c in answer.choices] == [0, 1]
    ids = [tok.bos_id, *tok.encode(text)]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == answer.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) and by_ids.usage.completion_tokens == 8
    assert answer.usage.prompt_tokens == len(ids) + 1 + len(tok.encode("The king"))


def test_completion_streaming_joins_to_the_whole_answer_for_each_choice(client):
    base = dict(model=MODEL_NAME, prompt=["Once upon", "ROMEO:"], max_tokens=12, temperature=0, n=2)
    whole = client.completions.create(**base)
    chunks = list(client.completions.create(**base, stream=True))
    for choice in whole.choices:
        parts = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(p.text for p in parts) == choice.text
        assert [p.finish_reason for p in parts if p.finish_reason] == [choice.finish_reason]


def test_echo_with_logprobs_scores_every_prompt_token_as_the_forward_does(client, reference):
    model, tok = reference
    ids = [tok.bos_id, *tok.encode("Now is the winter of our discontent")]
    answer = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1, echo=True, logprobs=2, temperature=0)
    lp = answer.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(ids) + 1 and lp.tokens[: len(ids)] == [tok.decode([t]) for t in ids]
    (generated,) = engine_answer(reference, ids, max_new_tokens=1, temperature=0.0, stop_token_ids=[])
    want = forward_logprobs(model, ids + generated.tokens)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-4, rtol=0)
    for chosen, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert chosen in top.values() and len(top) <= 3  # the 2 alternatives and the chosen token
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()))  # greedy
    assert answer.choices[0].text.startswith(tok.decode(ids))
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == 1
    scored = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    assert scored.usage.completion_tokens == 0 and scored.choices[0].text == tok.decode(ids)


def test_tokenize_and_detokenize_round_trip(server, reference):
    _, tok = reference
    url = server[0].url
    plain = requests.post(url + "/tokenize", json={"prompt": "Good morrow", "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode("Good morrow") and plain["count"] == len(plain["tokens"])
    assert plain["max_model_len"] == 1024
    with_bos = requests.post(url + "/tokenize", json={"prompt": "Good morrow"}).json()["tokens"]
    assert with_bos == [tok.bos_id, *plain["tokens"]]
    chat = requests.post(url + "/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert chat == chat_prompt_ids(tok, CHAT)
    assert requests.post(url + "/detokenize", json={"tokens": plain["tokens"]}).json() == {"prompt": "Good morrow"}
    info = requests.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.config["eos_token"] and "im_start" in info["chat_template"]


def test_health_says_ok_and_what_the_engine_holds(server):
    health = requests.get(server[0].url + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL_NAME
    assert {"pending", "waiting", "decoding", "finished", "cancelled"} <= set(health)


# -------------------------------------------------------------------------- bad requests and limits


GOOD_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
MALFORMED = {
    "bad-json": ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    "not-an-object": ("/v1/chat/completions", b'[1, 2]', 400, None),
    "wrong-type": ("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": "5"}, 400, "max_tokens"),
    "temperature-type": ("/v1/chat/completions", {**GOOD_CHAT, "temperature": "hot"}, 400, "temperature"),
    "unknown-model": ("/v1/chat/completions", {**GOOD_CHAT, "model": "gpt-9"}, 404, "model"),
    "no-messages": ("/v1/chat/completions", {**GOOD_CHAT, "messages": []}, 400, "messages"),
    "empty-turn": ("/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": " "}]}, 400, "messages"),
    "bad-role": ("/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    "negative-max-tokens": ("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": -1}, 400, "max_tokens"),
    "top-p-zero": ("/v1/chat/completions", {**GOOD_CHAT, "top_p": 0}, 400, "top_p"),
    "n-too-big": ("/v1/chat/completions", {**GOOD_CHAT, "n": 50}, 400, "n"),
    "chat-too-long": ("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": 1020}, 400, "max_tokens"),
    "prompt-too-long": ("/v1/completions", {"model": MODEL_NAME, "prompt": [5] * 1100, "max_tokens": 1}, 400, "prompt"),
    "prompt-plus-max-tokens": ("/v1/completions", {"model": MODEL_NAME, "prompt": [5] * 1000, "max_tokens": 100},
                               400, "max_tokens"),
    "token-outside-vocab": ("/v1/completions", {"model": MODEL_NAME, "prompt": [0, 99999]}, 400, "prompt"),
    "empty-prompt": ("/v1/completions", {"model": MODEL_NAME, "prompt": []}, 400, "prompt"),
    "max-tokens-0-without-echo": ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 0}, 400,
                                  "max_tokens"),
    "no-prompt": ("/v1/completions", {"model": MODEL_NAME}, 400, "prompt"),
    "tokenize-nothing": ("/tokenize", {}, 400, "prompt"),
    "seed-past-the-generator": ("/v1/chat/completions", {**GOOD_CHAT, "seed": 2**64}, 400, "seed"),
    "seed-below-the-generator": ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "seed": -(2**63) - 1}, 400,
                                 "seed"),
    "empty-stop": ("/v1/chat/completions", {**GOOD_CHAT, "stop": ""}, 400, "stop"),
    "empty-stop-streamed": ("/v1/chat/completions", {**GOOD_CHAT, "stop": "", "stream": True}, 400, "stop"),
    "empty-stop-in-a-list": ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "stop": ["a", ""]}, 400, "stop"),
    # 200k characters: more than 1024 tokens of at most a few dozen characters each can hold
    "text-past-the-context": ("/v1/completions", {"model": MODEL_NAME, "prompt": "ab " * 70_000}, 400, "prompt"),
    "chat-past-the-context": ("/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": "ab " * 70_000}]},
                              400, "messages"),
    "tokenize-past-the-context": ("/tokenize", {"prompt": "ab " * 70_000}, 400, "prompt"),
    "too-many-turns": ("/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": "a"}] * 4097},
                       400, "messages"),
    "batch-past-max-pending": ("/v1/completions", {"model": MODEL_NAME, "prompt": ["a"] * 33, "n": 2}, 400, "prompt"),
    "unknown-route": ("/v1/embeddings", {"model": MODEL_NAME}, 404, None),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_request_gets_a_4xx_json_error_and_the_server_keeps_serving(server, name):
    path, body, status, param = MALFORMED[name]
    url = server[0].url + path
    if isinstance(body, bytes):
        response = requests.post(url, data=body, headers={"Content-Type": "application/json"})
    else:
        response = requests.post(url, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    good = requests.post(server[0].url + "/v1/chat/completions", json=GOOD_CHAT)
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_text_past_the_context_is_refused_before_it_is_tokenized(server, monkeypatch):
    served = server[1]
    calls = []
    monkeypatch.setattr(served.tokenizer, "encode_batch", lambda texts: calls.append(texts) or [[1]])
    monkeypatch.setattr(served.tokenizer, "encode", lambda text: calls.append(text) or [1])
    text = "x" * (served.max_text_chars + 1)
    turns = [{"role": "user", "content": "Hi"}] * (served.max_text_chars // 20)  # short, but long once rendered
    for path, body in (("/v1/completions", {"model": MODEL_NAME, "prompt": text}),
                       ("/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": text}]}),
                       ("/v1/chat/completions", {**GOOD_CHAT, "messages": turns})):
        response = requests.post(server[0].url + path, json=body)
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert calls == []



@pytest.mark.parametrize("param, subject", [("messages", "the messages have"), ("prompt", "the prompt has")])
def test_a_context_error_reads_as_english_for_the_prompt_and_the_messages(param, subject):
    from types import SimpleNamespace

    from lmforge.serve.app import Served
    from lmforge.serve.protocol import APIError

    served = SimpleNamespace(max_len=512, max_text_chars=100)
    with pytest.raises(APIError) as err:
        Served.check_length(served, [1] * 11, 600, param)
    assert err.value.message == (f"this model's context is 512 tokens; {subject} 11 and max_tokens asks for 600 more: "
                                 f"shorten the {param} or lower max_tokens")
    with pytest.raises(APIError) as err:
        Served.check_chars(served, 101, param)
    assert err.value.message.startswith(f"{subject} 101 characters, more than this model's context of 512 tokens")


def test_the_openai_client_raises_its_own_errors_for_them(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=CHAT)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt=[5] * 1100, max_tokens=1)
    assert err.value.body["code"] == "context_length_exceeded"


def health(url: str) -> dict:
    return requests.get(url + "/health").json()


def wait_for(condition, what: str, tick=None, seconds: float = 60.0) -> None:
    """Poll ``condition`` (calling ``tick`` between polls) until it holds."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        if tick is not None:
            tick()
        time.sleep(0.02)


def gated(served) -> threading.Semaphore:
    """Make the engine wait for a permit before each forward pass, so a test decides how far
    a request gets (no race against a fast tiny model)."""
    gate = threading.Semaphore(0)
    gate.hook = served.worker.engine.net.layers[0].register_forward_pre_hook(lambda module, args: gate.acquire() and None)
    return gate


def long_stream(url: str) -> tuple[requests.Response, Iterator[str]]:
    """A chat stream that would run to the end of the context (ignore_eos), opened, its first
    event read; and its lines (dropping that iterator would drop the connection)."""
    body = {**GOOD_CHAT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    response = requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60)
    lines = response.iter_lines(decode_unicode=True)
    assert next(line for line in lines if line.startswith("data: "))
    return response, lines


def test_a_client_that_disconnects_mid_stream_frees_its_slot(checkpoint):
    background, served = start_server(checkpoint, max_batch=1)
    gate = gated(served)
    try:
        url = background.url
        response, lines = long_stream(url)
        gate.release(3)  # the prefill and two decode steps
        wait_for(lambda: health(url)["decoding"] == 1, "the request to decode")
        response.close()
        # one more step per poll: the 1000 tokens would take 1000 polls, the disconnect a few
        wait_for(lambda: health(url)["cancelled"] == 1, "the server to notice the disconnect", tick=gate.release)
        gate.release(10_000)
        wait_for(lambda: health(url)["decoding"] == 0, "its row to leave the batch")
        after = health(url)
        assert after["pending"] == 0 and after["finished"] == 0  # cancelled, not run to its end
        good = requests.post(url + "/v1/chat/completions", json=GOOD_CHAT, timeout=60)  # the one slot serves again
        assert good.status_code == 200 and health(url)["finished"] == 1
    finally:
        gate.release(10_000)
        background.stop()


def test_requests_past_max_pending_get_429_and_the_server_recovers(checkpoint):
    background, served = start_server(checkpoint, max_batch=1, max_pending=1)
    gate = gated(served)
    try:
        url = background.url
        response, lines = long_stream(url)  # held at its prefill by the gate
        refused = requests.post(url + "/v1/chat/completions", json=GOOD_CHAT)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        response.close()
        gate.release(10_000)
        wait_for(lambda: health(url)["pending"] == 0, "the stream's request to be dropped")
        assert requests.post(url + "/v1/chat/completions", json=GOOD_CHAT, timeout=60).status_code == 200
    finally:
        gate.release(10_000)
        background.stop()


def test_a_seed_past_the_generators_range_is_refused_and_fails_no_request_decoding_beside_it(checkpoint):
    # 2^64 once joined the batch, and the step that made its generator failed every request in it
    background, served = start_server(checkpoint, max_batch=4)
    gate = gated(served)
    try:
        url = background.url + "/v1/chat/completions"
        body = {**GOOD_CHAT, "max_tokens": 12, "ignore_eos": True, "temperature": 1.0, "seed": 5}
        response = requests.post(url, json={**body, "stream": True}, stream=True, timeout=60)
        lines = response.iter_lines(decode_unicode=True)
        assert next(line for line in lines if line.startswith("data: "))
        gate.release(2)  # its prefill and a step: it is decoding
        wait_for(lambda: health(background.url)["decoding"] == 1, "the stream to decode")
        bad = requests.post(url, json={**GOOD_CHAT, "seed": 2**64}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "seed"
        gate.release(10_000)
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert streamed == requests.post(url, json=body, timeout=60).json()["choices"][0]["message"]["content"]
    finally:
        gate.release(10_000)
        background.stop()


def stream_events(url: str, body: dict) -> list[str]:
    with requests.post(url, json={**body, "stream": True}, stream=True, timeout=60) as response:
        assert response.status_code == 200
        return [line[len("data: "):] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]


def test_a_stream_that_fails_sends_an_error_event_then_done(server, monkeypatch):
    from lmforge.serve import app

    url = server[0].url
    body = {**GOOD_CHAT, "max_tokens": 6, "ignore_eos": True}

    def broken(self, token):
        raise RuntimeError("a bug in the handler")

    with monkeypatch.context() as patch:  # the handler fails while streaming
        patch.setattr(app.TextDelta, "add", broken)
        events = stream_events(url + "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "a bug in the handler" in error["message"]

    engine = server[1].worker.engine
    record = engine.record

    def fails_one(row, *args):  # the engine fails one request, the one asking for 5 tokens
        if row.config.max_new_tokens == 5:
            raise RuntimeError("one row broke")
        return record(row, *args)

    with monkeypatch.context() as patch:
        patch.setattr(engine, "record", fails_one)
        events = stream_events(url + "/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 5})
        assert events[-1] == "[DONE]" and "one row broke" in json.loads(events[-2])["error"]["message"]
        assert json.loads(stream_events(url + "/v1/chat/completions", body)[-2])["choices"][0]["finish_reason"] == "length"


def test_an_empty_api_key_is_refused_at_startup_wherever_it_comes_from(checkpoint, monkeypatch):
    from lmforge.core.io import InputError
    from lmforge.serve.app import Served
    from lmforge.stages.serve import ServeRecipe, build_served

    monkeypatch.delenv("LMFORGE_API_KEY", raising=False)
    for key in ("", "  "):
        with pytest.raises(InputError, match="--api-key .* is empty"):
            build_served(ServeRecipe(checkpoint=str(checkpoint), device="cpu", api_key=key))
    monkeypatch.setenv("LMFORGE_API_KEY", "")
    with pytest.raises(InputError, match="LMFORGE_API_KEY is empty"):
        build_served(ServeRecipe(checkpoint=str(checkpoint), device="cpu"))
    with pytest.raises(ValueError, match="API key is empty"):
        Served(None, Tokenizer.load(checkpoint), "m", 8, 8, api_key="")
    monkeypatch.delenv("LMFORGE_API_KEY")
    proc = subprocess.run([sys.executable, "-m", "lmforge", "serve", f"checkpoint={checkpoint}", "--port", "0",
                           "device=cpu", "--api-key", ""], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--api-key (recipe key api_key) is empty" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not proc.stdout


def test_an_api_key_is_required_when_the_server_has_one(checkpoint):
    background, _ = start_server(checkpoint, api_key="sesame")
    try:
        url = background.url
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            response = requests.post(url + "/v1/chat/completions", json=GOOD_CHAT, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        assert keyed.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2).choices
        assert requests.get(url + "/health").status_code == 200 and requests.get(url + "/").status_code == 200  # open
    finally:
        background.stop()


def test_lmforge_serve_port_0_prints_the_url_of_a_free_port_on_localhost(checkpoint):
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", "serve", f"checkpoint={checkpoint}", "--port", "0",
                             "device=cpu", "model_name=tiny", "log_level=warning"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" on ")[1].split()[0]
        assert not url.endswith(":0") and url.startswith("http://127.0.0.1:")
        wait_for(lambda: probe(url), "the server to answer")
        answer = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=3)
        assert answer.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def probe(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=2).status_code == 200
    except requests.ConnectionError:
        return False


# -------------------------------------------------------------------------- stop tokens


def ender_checkpoint(directory, tokenizer_dir, token: int):
    """A model that answers every context with ``token``: its final LayerNorm's gain is zero and
    its bias a unit vector, so only ``token``'s row of the head sees it (logit 10, others 0)."""
    from lmforge.checkpoints.files import write_checksums, write_model_files
    from lmforge.model.config import ModelConfig
    from lmforge.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=4, max_seq_len=128,
                                    norm="layernorm", tie_embeddings=False))
    with torch.no_grad():
        model.norm.weight.zero_()
        model.norm.bias.zero_()
        model.norm.bias[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[token, 0] = 10.0
    write_model_files(directory, model, tokenizer_dir)
    write_checksums(directory)
    return directory


def test_a_chat_answer_ends_at_im_end_with_finish_reason_stop(tmp_path, small_tokenizer_dir, small_tokenizer):
    im_end = small_tokenizer.token_to_id(IM_END)
    background, _ = start_server(ender_checkpoint(tmp_path, small_tokenizer_dir, im_end))
    try:
        client = openai.OpenAI(base_url=background.url + "/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, logprobs=True)
        assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.content == ""
        assert answer.choices[0].logprobs.content == []  # <|im_end|> ends the turn; it is not content
        assert answer.usage.completion_tokens == 1  # but it was generated
        plain = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3)  # not a stop token here
        assert plain.choices[0].finish_reason == "length" and plain.choices[0].text == IM_END * 3
    finally:
        background.stop()


def test_an_echo_that_generates_the_stop_token_lists_it_last_for_the_scorer_to_drop(tmp_path, small_tokenizer_dir,
                                                                                   small_tokenizer):
    tok = small_tokenizer
    background, _ = start_server(ender_checkpoint(tmp_path, small_tokenizer_dir, tok.eos_id))
    try:
        client = openai.OpenAI(base_url=background.url + "/v1", api_key="x", max_retries=0)
        ids = [tok.bos_id, *tok.encode("To be, or not")]
        answer = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1, echo=True, logprobs=1)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and choice.text == tok.decode(ids)  # end of text is not text
        assert choice.logprobs.tokens == [tok.decode([t]) for t in ids] + [tok.config["eos_token"]]
        assert len(choice.logprobs.token_logprobs) == len(ids) + 1
        assert choice.logprobs.token_logprobs[-1] == pytest.approx(max(choice.logprobs.top_logprobs[-1].values()))
    finally:
        background.stop()
