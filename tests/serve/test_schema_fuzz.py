"""`lmforge serve` fuzzed from its own schema: request bodies drawn from the OpenAPI document
the server serves (``from_schema``: hypothesis strategies for the JSON-schema subset pydantic
writes), as they are, with one field replaced by any JSON value, as any JSON at all, or as
bytes that are not JSON;
none gets a 5xx, every 4xx is OpenAI's JSON error, every 200 stream ends with ``[DONE]``, and
the server answers ``/health`` after them all.

Bounded: a model of 64 positions (so a generation is at most 64 steps), a fixed number of
derandomized examples (the same cases every run, no flakiness), loopback only.
"""

from __future__ import annotations

import json
import time

import pytest
import requests
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from tests.serve.conftest import MODEL_NAME, start_server

EXAMPLES = 300  # ~20 s on a loaded 2-core machine; each example is one HTTP request
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                    max_leaves=10)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, small_tokenizer_dir):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=16, n_layers=1, n_heads=2, ffn_hidden=32, max_seq_len=64))
    path = tmp_path_factory.mktemp("fuzz-ckpt")
    write_model_files(path, model.eval(), small_tokenizer_dir)
    write_checksums(path)
    background, served = start_server(path, max_batch=8, max_body_bytes=64 * 1024)
    yield background, served
    background.stop()


def from_schema(schema: dict, spec: dict) -> st.SearchStrategy:
    """Values valid under ``schema``, a JSON schema as pydantic writes one (``$ref`` into the
    document's components, ``anyOf``, ``enum``, bounds of numbers, strings and arrays)."""
    if "$ref" in schema:
        return from_schema(spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]], spec)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, spec) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        properties = {k: from_schema(v, spec) for k, v in schema.get("properties", {}).items()}
        required = set(schema.get("required", []))
        return st.fixed_dictionaries({k: v for k, v in properties.items() if k in required},
                                     optional={k: v for k, v in properties.items() if k not in required})
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), spec), min_size=schema.get("minItems", 0),
                        max_size=schema.get("maxItems", 12))
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 40))
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        return st.integers(None if low is None else int(low), None if high is None else int(high))
    if kind == "number":
        return st.floats(schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum"),
                         exclude_min="exclusiveMinimum" in schema, allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JSON  # no constraint: any JSON value


def operations(spec: dict) -> list[tuple[str, str, dict | None]]:
    """(method, path, body schema or None) of every operation."""
    out = []
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            out.append((method, path, schema))
    return out


def requests_of(spec: dict) -> st.SearchStrategy:
    """(method, path, body bytes or None) drawn from the document: valid, one field off, any JSON, not JSON."""
    def bodies(op: tuple[str, str, dict | None]) -> st.SearchStrategy:
        method, path, schema = op
        if schema is None:
            return st.just((method, path, None))
        valid = from_schema(schema, spec).flatmap(
            lambda body: st.sampled_from([MODEL_NAME] * 3 + [body.get("model")]).map(  # mostly the served model's id
                lambda model: {**body, "model": model} if model is not None else body))
        off = valid.flatmap(lambda body: st.sampled_from(sorted(body) or ["model"]).flatmap(
            lambda key: JSON.map(lambda value: {**body, key: value})))
        as_json = st.one_of(valid, valid, valid, off, JSON).map(lambda body: json.dumps(body).encode())
        return st.one_of(as_json, st.binary(max_size=64)).map(lambda raw: (method, path, raw))

    return st.sampled_from(operations(spec)).flatmap(bodies)


def check_answer(response: requests.Response, what: str) -> None:
    assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], what
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", f"{what}: the stream ended without [DONE]: {events[-3:]}"
        assert not any('"server_error"' in e for e in events), f"{what}: {events}"


def test_requests_drawn_from_the_servers_schema_never_get_a_5xx(fuzzed):
    url = fuzzed[0].url
    spec = requests.get(url + "/openapi.json", timeout=30).json()
    assert {p for _, p, s in operations(spec) if s} == {"/v1/chat/completions", "/v1/completions", "/tokenize",
                                                        "/detokenize"}
    session = requests.Session()
    statuses: dict[int, int] = {}
    start = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests_of(spec))
    def one(request):
        method, path, body = request
        response = session.request(method, url + path, data=body, timeout=60,
                                   headers={"Content-Type": "application/json"} if body is not None else {})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        check_answer(response, f"{method.upper()} {path} {body[:300]!r}" if body else f"{method.upper()} {path}")

    one()
    assert time.monotonic() - start < 120, "the fuzzing ran past its time bound"
    assert statuses.get(200, 0) > EXAMPLES // 20, statuses  # past validation often enough to test generation
    assert requests.get(url + "/health", timeout=10).json()["status"] == "ok"
