"""The OpenAI-compatible judge: retries with backoff, timeouts, a deadline per request against a
server trickling its reply, replies cut short, malformed JSON, refusals and the API key
against a local fake endpoint that counts its requests; the cache makes a rerun
send none; and `lmforge serve` running a tiny model as the endpoint gives `cai label` the
same labels as the same checkpoint judging in process."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lmforge.core.config import load_config
from lmforge.feedback.judges import Chat, Comparison, EndpointJudge, JudgeConfig, JudgeError, JudgeRefused
from lmforge.stages.cai import CAIRecipe, run_cai
from tests.conftest import REPO

pytestmark = pytest.mark.usefixtures("one_thread")

CONSTITUTION = str(REPO / "data" / "constitutions" / "demo_tasks.yaml")


def completion(text: str, **choice) -> dict:
    return {"id": "x", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                         **choice}]}


def shorter_answer(body: dict) -> dict:
    """A judge preferring the shorter option, answering in text (no log-probs)."""
    text = body["messages"][-1]["content"]
    match = re.search(r"\n\(A\) (.*)\n\(B\) (.*)\n\nAnswer", text, re.S)
    if match is None:
        return completion("a critique")
    a, b = match.groups()
    return completion("(A)" if len(a) <= len(b) else "(B)")


class FakeEndpoint:
    """A local /v1/chat/completions: each request takes the next scripted reply
    (status, body bytes or dict, delay; or a function writing the raw reply itself), then answers
    by ``shorter_answer``; every request is kept."""

    def __init__(self):
        self.script, self.requests = [], []
        self.stop = threading.Event()  # set on close: a trickling reply stops
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                status, reply, delay = fake.script.pop(0) if fake.script else (200, shorter_answer(body), 0)
                time.sleep(delay)
                if callable(reply):
                    try:
                        reply(self, fake.stop)
                    except (BrokenPipeError, ConnectionResetError):  # the client gave up (its deadline)
                        pass
                    return
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout)
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def endpoint():
    fake = FakeEndpoint()
    yield fake
    fake.close()


def judge(endpoint, tmp_path=None, **cfg) -> EndpointJudge:
    sleeps = []
    j = EndpointJudge(JudgeConfig(base_url=endpoint.url, model="m", **cfg),
                      cache_dir=None if tmp_path is None else tmp_path / "cache", sleep=sleeps.append)
    j.sleeps = sleeps
    return j


COMPARISON = Comparison("p.jsonl:3 samples 0,1 (x, y)", "2+2?", "4", "five", "Which is right?")


def test_a_judgement_is_one_chat_completion_request_with_log_probs_and_the_key(endpoint, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    (answer,) = judge(endpoint, api_key_env="JUDGE_KEY").compare([COMPARISON])
    (request,) = endpoint.requests
    assert request["path"] == "/v1/chat/completions" and request["auth"] == "Bearer sk-test"
    body = request["body"]
    assert body["model"] == "m" and body["messages"] == COMPARISON.messages and body["temperature"] == 0.0
    assert body["logprobs"] is True and body["top_logprobs"] == 20 and body["max_tokens"] == 8
    assert answer.text == "(A)" and answer.tokens is None


def test_server_errors_are_retried_with_exponential_backoff(endpoint):
    endpoint.script = [(503, {"error": {"message": "busy"}}, 0), (429, b"slow down", 0)]
    j = judge(endpoint, backoff_s=0.5)
    assert j.generate([Chat("k", [{"role": "user", "content": "hi"}])]) == ["a critique"]
    assert j.requests_sent == len(endpoint.requests) == 3 and j.sleeps == [0.5, 1.0]


def test_an_endpoint_that_keeps_failing_is_an_error_naming_the_item_after_the_retries(endpoint):
    endpoint.script = [(500, {"error": {"message": "boom"}}, 0)] * 3
    j = judge(endpoint, max_retries=2, backoff_s=0.1)
    with pytest.raises(JudgeError, match=r"p.jsonl:3 samples 0,1 \(x, y\): .* failed after 3 attempt\(s\): "
                                         r"HTTP 500: boom"):
        j.compare([COMPARISON])
    assert len(endpoint.requests) == 3 and j.sleeps == [0.1, 0.2]


def test_a_timeout_is_retried_then_an_error(endpoint):
    endpoint.script = [(200, completion("(A)"), 2.0)] * 2
    j = judge(endpoint, max_retries=1, backoff_s=0.0, timeout_s=0.2)
    with pytest.raises(JudgeError, match=r"failed after 2 attempt\(s\): timed out after 0.2 s"):
        j.compare([COMPARISON])


def trickle(where: str, every_s: float = 0.25):
    """A reply whose status line and headers (``where="headers"``) or body trickle in a byte every
    ``every_s`` s: about 2 minutes in all, each read of it far shorter than any timeout."""
    def send(handler, stop):
        data = json.dumps(completion("(A)")).encode() + b" " * 400
        head = (f"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                .encode())
        slow = head + data if where == "headers" else data
        if where == "body":
            handler.wfile.write(head)
        for i in range(len(slow)):
            if stop.is_set():
                return
            handler.wfile.write(slow[i:i + 1])
            time.sleep(every_s)
    return send


def cut_short(handler, stop):
    """A reply 50 bytes shorter than its Content-Length, then the connection closes."""
    data = json.dumps(completion("(A)")).encode()
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(data) + 50))
    handler.end_headers()
    handler.wfile.write(data)


def within(seconds: float, fn) -> tuple[dict, float]:
    """``fn()``'s value or exception, and the seconds it took; a test failure if it is still running
    after ``seconds`` (it runs in a daemon thread, so a hang fails the test instead of hanging it)."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread, start = threading.Thread(target=target, daemon=True), time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    return box, time.monotonic() - start


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_server_trickling_its_reply_is_cut_off_at_each_attempts_deadline(endpoint, where):
    endpoint.script = [(200, trickle(where), 0)] * 2
    j = judge(endpoint, max_retries=1, backoff_s=0.0, timeout_s=1.0)
    # Each attempt ends at its deadline: every read waits at most what is left of the attempt's
    # timeout_s, so 2 attempts take 2 x 1 s plus thread scheduling; 3 s more covers a loaded
    # 2-core machine. A timeout per read (the code before) would wait out the ~2 minute reply.
    box, elapsed = within(1.0 * (1 + 1) + 3.0, lambda: j.compare([COMPARISON]))
    assert isinstance(box.get("error"), JudgeError), box
    assert str(box["error"]).endswith("failed after 2 attempt(s): timed out after 1 s (answers already judged are "
                                      "kept; rerun to resume)")
    assert len(endpoint.requests) == 2 and elapsed >= 2 * 1.0  # both attempts ran to their deadline


def test_a_reply_shorter_than_its_content_length_is_retried(endpoint):
    endpoint.script = [(200, cut_short, 0)]
    j = judge(endpoint, max_retries=1, backoff_s=0.5)
    assert j.generate([Chat("k", [{"role": "user", "content": "hi"}])]) == ["a critique"]
    assert len(endpoint.requests) == 2 and j.sleeps == [0.5]


def test_a_reply_cut_short_every_time_is_one_line_naming_the_item(endpoint):
    endpoint.script = [(200, cut_short, 0)] * 2
    with pytest.raises(JudgeError) as err:
        judge(endpoint, max_retries=1, backoff_s=0.0).compare([COMPARISON])
    message = str(err.value)
    assert re.fullmatch(r"p.jsonl:3 samples 0,1 \(x, y\): \S+ failed after 2 attempt\(s\): a broken HTTP reply: "
                        r"IncompleteRead\(\d+ bytes read, 50 more expected\) \(.*\)", message), message
    assert len(endpoint.requests) == 2


@pytest.mark.parametrize("reply, message", [
    (b"<html>gateway</html>", "returned malformed JSON"),
    ({"object": "error"}, "not a chat completion"),
    (completion(None), "without text content"),
])
def test_malformed_replies_are_errors_naming_the_item(endpoint, reply, message):
    endpoint.script = [(200, reply, 0)]
    with pytest.raises(JudgeError, match=f"p.jsonl:3 samples 0,1 .*{message}"):
        judge(endpoint).compare([COMPARISON])
    assert len(endpoint.requests) == 1


@pytest.mark.parametrize("status, reply, message", [
    (400, {"error": {"message": "max_tokens is too large"}}, "refused the request: HTTP 400: max_tokens is too large"),
    (401, {"error": {"message": "bad key"}}, r"HTTP 401: bad key \(no API key was sent: set \$LMFORGE_TEST_NO_KEY\)"),
    (200, {"choices": [{"message": {"content": None, "refusal": "I can't judge that."}}]}, "refused: I can't judge"),
    (200, completion("", finish_reason="content_filter"), "refused: content filter"),
])
def test_a_refusal_is_not_retried_and_names_the_item(endpoint, status, reply, message):
    endpoint.script = [(status, reply, 0)]
    with pytest.raises(JudgeRefused, match=f"p.jsonl:3 samples 0,1 .*{message}"):
        judge(endpoint, api_key_env="LMFORGE_TEST_NO_KEY").compare([COMPARISON])
    assert len(endpoint.requests) == 1


def test_log_probs_the_endpoint_returns_become_the_answer_tokens(endpoint):
    content = [{"token": "(", "logprob": -0.01, "top_logprobs": [{"token": "(", "logprob": -0.01}]},
               {"token": "B", "logprob": -0.2, "top_logprobs": [{"token": "B", "logprob": -0.2},
                                                                {"token": "A", "logprob": -1.8}]}]
    endpoint.script = [(200, completion("(B)", logprobs={"content": content}), 0)]
    (answer,) = judge(endpoint).compare([COMPARISON])
    assert [t.text for t in answer.tokens] == ["(", "B"] and answer.tokens[1].top == [("B", -0.2), ("A", -1.8)]


def test_the_cache_answers_a_rerun_without_a_request(endpoint, tmp_path):
    items = [Comparison(f"k{i}", "q", "a" * i, "bb", "Which?") for i in range(4)]
    first = judge(endpoint, tmp_path, concurrency=3).compare(items)
    assert len(endpoint.requests) == 4
    again = judge(endpoint, tmp_path)
    assert again.compare(items) == first and again.requests_sent == 0 and len(endpoint.requests) == 4
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 4


def recipe(run_dir, checkpoint, prompts, *overrides) -> CAIRecipe:
    return load_config(CAIRecipe, None, [f"run_dir={run_dir}", f"checkpoint={checkpoint}", f"data.prompts=[{prompts}]",
                                         f"constitution={CONSTITUTION}", "rollout.n=3", "rollout.max_new_tokens=6",
                                         "prompts_per_chunk=3", "device=cpu", "judge.device=cpu", *overrides])


def test_cai_label_through_an_endpoint_resumes_from_its_cache_without_a_request(endpoint, tmp_path, judge_checkpoint,
                                                                                prompts):
    r = recipe(tmp_path / "cai", judge_checkpoint, prompts, f"judge.base_url={endpoint.url}", "judge.model=m",
               "judge.max_retries=0")
    endpoint.script = [(200, completion("(A)"), 0)] * 4 + [(503, {"error": {"message": "down"}}, 0)]
    with pytest.raises(JudgeError, match="HTTP 503: down"):  # the first chunk is written, the second fails
        run_cai(r)
    sent = len(endpoint.requests)
    summary = run_cai(r)
    resent = list(endpoint.requests[sent:])
    assert (sent - 1) + len(resent) == 2 * summary["pairs_judged"]  # each comparison answered once, the failed one again
    (tmp_path / "cai" / "judgements.jsonl").unlink()
    again = run_cai(r)  # every answer is in the cache now
    assert len(endpoint.requests) == sent + len(resent) and again == summary
    assert summary["answers_read_by"] == {"parsed": 2 * summary["pairs_judged"]} and summary["pairs_judged"] > 0


def cai_command(tmp_path, judge_checkpoint, prompts, *overrides) -> list[str]:
    return ["cai", "label", f"run_dir={tmp_path / 'cai'}", f"checkpoint={judge_checkpoint}", f"data.prompts=[{prompts}]",
            f"constitution={CONSTITUTION}", "rollout.n=3", "rollout.max_new_tokens=6", "device=cpu", *overrides]


def test_lmforge_cai_stops_at_the_deadline_of_a_trickling_endpoint_with_one_error_line(endpoint, tmp_path,
                                                                                       judge_checkpoint, prompts,
                                                                                       capsys):
    from lmforge.cli.main import main

    endpoint.script = [(200, trickle("body"), 0)] * 100
    command = cai_command(tmp_path, judge_checkpoint, prompts, f"judge.base_url={endpoint.url}", "judge.model=m",
                          "judge.timeout_s=1", "judge.max_retries=0", "judge.concurrency=2")
    # The first failed comparison ends the batch (requests not yet sent are cancelled): the 2 in
    # flight end at their 1 s deadline; 30 s covers loading the tiny policy and sampling on a loaded
    # machine. Before, each request waited out its ~2 minute reply.
    box, elapsed = within(1.0 + 30.0, lambda: main(command))
    err = capsys.readouterr().err
    assert box == {"value": 2}, (box, err)
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert re.fullmatch(r"lmforge cai: error: \S+ samples \d,\d \([xy], [xy]\): \S+ failed after 1 attempt\(s\): timed out "
                        r"after 1 s \(.*\)", errors[0]), errors[0]
    assert len(endpoint.requests) <= 2  # only the requests in flight were sent


def test_lmforge_cai_reports_an_endpoint_cutting_its_replies_short_as_one_error_line(endpoint, tmp_path,
                                                                                     judge_checkpoint, prompts, capsys):
    from lmforge.cli.main import main

    endpoint.script = [(200, cut_short, 0)] * 100
    code = main(cai_command(tmp_path, judge_checkpoint, prompts, f"judge.base_url={endpoint.url}", "judge.model=m",
                            "judge.max_retries=1", "judge.backoff_s=0", "judge.concurrency=1"))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert re.fullmatch(r"lmforge cai: error: \S+ samples \d,\d \([xy], [xy]\): \S+ failed after 2 attempt\(s\): a broken "
                        r"HTTP reply: IncompleteRead\(.*\) \(.*\)", errors[0]), errors[0]
    assert len(endpoint.requests) == 2


pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")


@pytest.fixture(scope="module")
def served(judge_checkpoint):
    from lmforge.serve.app import create_app
    from lmforge.serve.server import BackgroundServer
    from lmforge.stages.serve import ServeRecipe, build_served

    server = BackgroundServer(create_app(build_served(ServeRecipe(checkpoint=str(judge_checkpoint), model_name="tiny",
                                                                   device="cpu", max_batch=8)))).start()
    yield server
    server.stop()


def test_lmforge_serve_as_the_judge_gives_the_in_process_judges_labels(tmp_path, served, judge_checkpoint, prompts):
    local = run_cai(recipe(tmp_path / "local", judge_checkpoint, prompts, f"judge.checkpoint={judge_checkpoint}",
                           "label.on_no_choice=skip"))
    remote = run_cai(recipe(tmp_path / "remote", judge_checkpoint, prompts, f"judge.base_url={served.url}/v1",
                            "judge.model=tiny", "judge.concurrency=4", "label.on_no_choice=skip"))
    soft = [p for x in (tmp_path / "local" / "judgements.jsonl").read_text().splitlines()
            for pair in json.loads(x)["pairs"] for p in pair.get("p_x", [])]
    assert any(0.01 < p < 0.99 for p in soft)  # soft labels, not only sure or parsed choices
    assert local["kept"] > 0 and local["answers_read_by"] == {"logprobs": 2 * local["pairs_judged"]}
    for key in ("pairs_judged", "kept", "dropped", "answers_read_by", "disagreement_rate"):
        assert remote[key] == local[key], key
    mine = [json.loads(x) for x in (tmp_path / "local" / "judgements.jsonl").read_text().splitlines()]
    theirs = [json.loads(x) for x in (tmp_path / "remote" / "judgements.jsonl").read_text().splitlines()]
    for a, b in zip(mine, theirs, strict=True):
        assert a["samples"] == b["samples"]
        for pa, pb in zip(a["pairs"], b["pairs"], strict=True):
            assert pa["answers"] == pb["answers"] and pa["read"] == pb["read"]
            # the server batches other requests with each: its log-probs agree to float32 rounding (~1e-6), and
            # P(A) = σ(lp_A - lp_B) moves by at most a quarter of a change in the difference
            assert pa.get("p_x", [0, 0]) == pytest.approx(pb.get("p_x", [0, 0]), abs=1e-5)
    a_pairs = (tmp_path / "local" / "pairs.jsonl").read_text().splitlines()
    b_pairs = (tmp_path / "remote" / "pairs.jsonl").read_text().splitlines()
    assert [json.loads(x)["chosen"] for x in a_pairs] == [json.loads(x)["chosen"] for x in b_pairs]
