"""What one client can hold of `lmforge serve`: a body past max_body_bytes gets 413, a body
not sent within body_timeout_s 408 and its connection closed, a connection that sends no whole
request head within head_timeout_s is closed (silent, or a byte at a time, or after a first
request), past max_connections a request gets 503, and prompts are tokenized off the event
loop, so /health answers while one is tokenized."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import requests

from tests.serve.conftest import MODEL_NAME, start_server

LIMITS = dict(max_body_bytes=4096, body_timeout_s=1.0, head_timeout_s=1.0)
SLACK = 5.0  # seconds past a deadline before a test calls the connection left open (a loaded 2-core machine)
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def limited(checkpoint):
    background, served = start_server(checkpoint, **LIMITS)
    yield background, served
    background.stop()


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=LIMITS["head_timeout_s"] + SLACK)
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took;
    a socket timeout (the server kept it open) fails the test."""
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def read_response(sock: socket.socket) -> bytes:
    """One whole response (its head and Content-Length bytes of body) from a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return data


def error_of(response: requests.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_a_body_declared_past_the_limit_gets_413_before_it_is_read(limited):
    response = requests.post(limited[0].url + "/v1/chat/completions", data=b"x" * 5000,
                             headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"
    assert "max_body_bytes" in error_of(response)["message"]
    assert requests.post(limited[0].url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_a_chunked_body_that_grows_past_the_limit_gets_413(limited):
    def body():
        for _ in range(10):
            yield b"x" * 1000

    response = requests.post(limited[0].url + "/v1/chat/completions", data=body(),
                             headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"


def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_closed(limited):
    with connect(limited[0].url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")  # 10 of the 100 bytes, then nothing
        data, seconds = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in data
    assert LIMITS["body_timeout_s"] * 0.9 <= seconds < LIMITS["body_timeout_s"] + SLACK


@pytest.mark.parametrize("how", ["silent", "partial-head", "a-byte-at-a-time", "after-a-request"])
def test_a_connection_without_a_whole_request_head_is_closed_at_the_head_timeout(limited, how):
    with connect(limited[0].url) as sock:
        if how == "partial-head":
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        elif how == "a-byte-at-a-time":
            head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100

            def drip():
                try:
                    for byte in head:
                        sock.send(bytes([byte]))
                        time.sleep(0.1)  # every byte well inside any read timeout; the head never ends
                except OSError:
                    pass  # closed by the server, as it should be

            threading.Thread(target=drip, daemon=True).start()
        elif how == "after-a-request":
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        data, seconds = read_until_closed(sock)
    assert data == b"" and seconds < LIMITS["head_timeout_s"] + SLACK


def test_past_max_connections_a_request_gets_503_and_served_again_once_they_close(checkpoint):
    background, _ = start_server(checkpoint, max_connections=3, head_timeout_s=60.0)
    try:
        held = [connect(background.url) for _ in range(3)]
        time.sleep(0.2)  # let the server's loop accept them
        assert requests.get(background.url + "/health", timeout=30).status_code == 503
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 30
        while requests.get(background.url + "/health", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the server did not serve again once the connections closed"
            time.sleep(0.05)
    finally:
        background.stop()


@pytest.mark.parametrize("route", ["chat", "completion", "tokenize"])
def test_a_prompt_is_tokenized_off_the_event_loop_so_health_answers_meanwhile(limited, monkeypatch, route):
    served = limited[1]
    entered, release = threading.Event(), threading.Event()

    def held(original):
        def encode(*args):
            entered.set()
            assert release.wait(60)
            return original(*args)
        return encode

    monkeypatch.setattr(served.tokenizer, "encode", held(served.tokenizer.encode))
    monkeypatch.setattr(served.tokenizer, "encode_batch", held(served.tokenizer.encode_batch))
    path, body = {"chat": ("/v1/chat/completions", CHAT),
                  "completion": ("/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}),
                  "tokenize": ("/tokenize", {"prompt": "Hi"})}[route]
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(r=requests.post(limited[0].url + path, json=body, timeout=60)))
    thread.start()
    try:
        assert entered.wait(30), "the request never reached the tokenizer"
        # the tokenizer is held: were it on the event loop, this would wait for it
        assert requests.get(limited[0].url + "/health", timeout=10).status_code == 200
    finally:
        release.set()
        thread.join(60)
    assert answer["r"].status_code == 200
