"""Property-based fuzzing of every reader: any bytes give records or a clear error, never another
exception, never a hang.

Each reader gets raw bytes and near-valid inputs built from valid data (JSON of the wrong types,
gzip cut short or with a byte flipped, Parquet columns of other types or with invalid UTF-8, WARC
records cut or altered anywhere), so the fuzzer reaches the paths behind the first parse. The
examples are derandomized, so CI sees the same ones every run; ``LMFORGE_SOAK=1`` draws many more,
at random, to look for new failures (``LMFORGE_SOAK=10``: ten times as many).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmforge.core.config import ConfigError, load_config
from lmforge.core.io import InputError

SOAK = int(os.environ.get("LMFORGE_SOAK") or 0)  # 1: 50 times the examples; a larger number: that many times
HANG_SECONDS = 20


def fuzz(examples: int) -> settings:
    """``examples`` derandomized examples; under LMFORGE_SOAK, many more drawn at random."""
    scale = (50 if SOAK == 1 else SOAK) if SOAK else 1
    return settings(max_examples=examples * scale, derandomize=not SOAK, deadline=None,
                    database=None, print_blob=bool(SOAK),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


class Hang(BaseException):
    """A reader that gave no answer within HANG_SECONDS (a BaseException: no reader's ``except`` takes it)."""


@contextlib.contextmanager
def no_hang(seconds: int = HANG_SECONDS) -> Iterator[None]:
    def alarm(signum, frame):
        raise Hang(f"no result after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def records_or_error(read: Callable[[], list], error: type[Exception] = InputError) -> list | None:
    """``read()``'s records, or None when it raised ``error`` with a message; any other exception fails the test."""
    with no_hang():
        try:
            return read()
        except error as exc:
            assert str(exc).strip(), "an error without a message"
            return None


@contextlib.contextmanager
def written(name: str, data: bytes) -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        path.write_bytes(data)
        yield path


# -- strategies: raw bytes and near-valid data

scalars = st.none() | st.booleans() | st.integers() | st.integers(min_value=-10**400, max_value=10**400) | \
    st.floats() | st.text(max_size=20)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)

TRICKY_LINES = [b"", b"\xef\xbb\xbf", b'{"text": "\\ud800"}', b'{"text": "a", "m": ' + b"[" * 900 + b'"\\u0041"'
                + b"]" * 900 + b"}", b'{"\\udfff": 1, "text": "a"}', b'{"text": NaN}',
                b'{"text": "a", "x": -Infinity}', b'{"text": 1e999}', b"[" * 5000, b'{"text": "\xff\xfe"}',
                b'{"text": "ok"}', b"\x00", b"\r", b'"just a string"', b"null", b'{"text": "a\\u0000b"}']


def json_line(value: Any, ascii_only: bool) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@st.composite
def jsonl_bytes(draw, record: st.SearchStrategy = json_values) -> bytes:
    """JSONL text: lines of JSON (often objects of the reader's fields), raw bytes and known-tricky lines."""
    line = st.one_of(st.builds(json_line, record, st.booleans()), st.binary(max_size=40), st.sampled_from(TRICKY_LINES))
    lines = draw(st.lists(line, max_size=8))
    return draw(st.sampled_from([b"\n", b"\r\n"])).join(lines) + draw(st.sampled_from([b"", b"\n"]))


document_records = st.one_of(
    json_values,
    st.fixed_dictionaries({"text": json_values}, optional={"id": json_values, "meta": json_values}),
    st.fixed_dictionaries({"text": st.text(max_size=30)}, optional={"id": scalars}),
)


@st.composite
def damaged(draw, data: bytes) -> bytes:
    """``data`` as it is, cut short, with a byte changed, or with bytes put in."""
    if not data:
        return data
    i = draw(st.integers(0, len(data) - 1))
    how = draw(st.sampled_from(["whole", "cut", "flip", "insert", "repeat"]))
    if how == "cut":
        return data[:i]
    if how == "flip":
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
    if how == "insert":
        return data[:i] + draw(st.binary(min_size=1, max_size=16)) + data[i:]
    if how == "repeat":
        return data[:i] + data + data[i:]
    return data


@st.composite
def gzip_bytes(draw, text: st.SearchStrategy) -> bytes:
    """Raw bytes, or gzip of ``text`` (in one member or several), whole or damaged."""
    if draw(st.integers(0, 5)) == 0:
        return draw(st.binary(max_size=200))
    parts = draw(st.lists(text, min_size=1, max_size=3))
    packed = b"".join(gzip.compress(p, mtime=0) for p in parts)
    return draw(damaged(packed))


def read_documents_of(path: Path, skip: bool, text_field: str = "text") -> list:
    from lmforge.data.documents import DocumentsConfig, read_documents

    docs = list(read_documents(DocumentsConfig(paths=[str(path)], skip_bad_records=skip, text_field=text_field)))
    for doc in docs:  # what a reader yields can be tokenized and written
        assert isinstance(doc.text, str) and doc.text and isinstance(doc.id, str)
        doc.text.encode("utf-8")
    return docs


# -- documents: JSONL, gzip JSONL, plain text, Parquet


@fuzz(200)
@given(data=jsonl_bytes(document_records), skip=st.booleans())
def test_jsonl_documents_are_records_or_an_input_error(data, skip):
    with written("d.jsonl", data) as path:
        records_or_error(lambda: read_documents_of(path, skip))


@fuzz(150)
@given(data=gzip_bytes(jsonl_bytes(document_records)), skip=st.booleans())
def test_gzip_jsonl_documents_are_records_or_an_input_error(data, skip):
    with written("d.jsonl.gz", data) as path:
        records_or_error(lambda: read_documents_of(path, skip))


@fuzz(100)
@given(data=st.one_of(st.binary(max_size=300), st.text().map(lambda t: t.encode("utf-8", "surrogatepass"))),
       compressed=st.booleans(), skip=st.booleans())
def test_plain_text_documents_are_records_or_an_input_error(data, compressed, skip):
    with written("d.txt.gz" if compressed else "d.txt", gzip.compress(data) if compressed else data) as path:
        records_or_error(lambda: read_documents_of(path, skip))


def column_values(kind: str) -> st.SearchStrategy:
    return {
        "string": st.lists(st.none() | st.text(max_size=20), min_size=1, max_size=6),
        "int": st.lists(st.none() | st.integers(-2**63, 2**63 - 1), min_size=1, max_size=6),
        "float": st.lists(st.none() | st.floats(), min_size=1, max_size=6),
        "list": st.lists(st.none() | st.lists(st.text(max_size=5), max_size=3), min_size=1, max_size=6),
        "binary": st.lists(st.none() | st.binary(max_size=20), min_size=1, max_size=6),
        "bad_utf8": st.lists(st.none() | st.binary(max_size=20), min_size=1, max_size=6),
    }[kind]


@st.composite
def parquet_bytes(draw, names: tuple[str, ...]) -> bytes:
    """A Parquet file whose columns (named from ``names``) hold values of any type, strings with
    invalid UTF-8 included, whole or damaged; or raw bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if draw(st.integers(0, 5)) == 0:
        return draw(st.binary(max_size=300))
    columns = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    kinds = [draw(st.sampled_from(["string", "string", "int", "float", "list", "binary", "bad_utf8"]))
             for _ in columns]
    n = draw(st.integers(1, 6))
    arrays = []
    for kind in kinds:
        values = (draw(column_values(kind)) * n)[:n]
        if kind == "bad_utf8":  # a string column whose bytes are not UTF-8: writers need not check
            arrays.append(pa.array(values, pa.binary()).view(pa.string()))
        else:
            arrays.append(pa.array(values))
    buffer = io.BytesIO()
    pq.write_table(pa.table(dict(zip(columns, arrays))), buffer, row_group_size=draw(st.integers(1, 4)))
    return draw(damaged(buffer.getvalue()))


@fuzz(150)
@given(data=parquet_bytes(("text", "id", "other")), skip=st.booleans())
def test_parquet_documents_are_records_or_an_input_error(data, skip):
    with written("d.parquet", data) as path:
        records_or_error(lambda: read_documents_of(path, skip))


# -- chat (SFT) and preference data

ROLE = st.sampled_from(["system", "user", "assistant", "tool", "", 3])
CONTENT = st.one_of(st.text(max_size=20), st.sampled_from(["", " ", "<|im_end|>", "<|im_start|>user\n"]),
                    json_values)
message = st.one_of(st.fixed_dictionaries({"role": ROLE, "content": CONTENT}),
                    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                           "content": st.text(min_size=1, max_size=20)}), json_values)
messages = st.lists(message, max_size=5)
prompt_like = st.one_of(st.text(max_size=20), messages, json_values)
sft_records = st.one_of(
    st.fixed_dictionaries({"messages": messages}),
    st.fixed_dictionaries({"prompt": prompt_like, "completion": prompt_like}),
    json_values,
)
preference_records = st.one_of(
    st.fixed_dictionaries({"prompt": prompt_like, "chosen": prompt_like, "rejected": prompt_like},
                          optional={"margin": json_values}),
    st.fixed_dictionaries({"chosen": messages, "rejected": messages}),
    st.fixed_dictionaries({"prompt": prompt_like, "completion": prompt_like, "label": json_values}),
    json_values,
)
policies = st.fixed_dictionaries({"on_bad": st.sampled_from(["error", "skip"]),
                                  "on_too_long": st.sampled_from(["error", "truncate", "skip"])})


def data_file(draw, records: st.SearchStrategy) -> tuple[str, bytes]:
    """A JSONL (sometimes gzipped) or Parquet file of ``records``."""
    kind = draw(st.sampled_from(["jsonl", "jsonl", "jsonl.gz", "parquet"]))
    if kind == "parquet":
        return "data.parquet", draw(parquet_bytes(("messages", "prompt", "completion", "chosen", "rejected",
                                                   "label", "margin")))
    data = draw(jsonl_bytes(records))
    return (f"data.{kind}", draw(gzip_bytes(st.just(data)))) if kind.endswith(".gz") else ("data.jsonl", data)


@fuzz(200)
@given(st.data())
def test_sft_examples_are_records_or_an_input_error(small_tokenizer, data):
    from lmforge.data.chat import read_sft_examples

    name, content = data_file(data.draw, sft_records)
    max_length, policy, assistant_only = data.draw(st.integers(1, 48)), data.draw(policies), data.draw(st.booleans())
    with written(name, content) as path:
        examples = records_or_error(lambda: list(read_sft_examples([str(path)], small_tokenizer, max_length,
                                                                   assistant_only=assistant_only, **policy)))
    for ex in examples or []:
        assert len(ex.input_ids) == len(ex.labels) <= max_length


@fuzz(200)
@given(st.data())
def test_preference_pairs_and_kto_examples_are_records_or_an_input_error(small_tokenizer, data):
    import math

    from lmforge.data.preference import read_preference_pairs, read_unpaired_examples

    name, content = data_file(data.draw, preference_records)
    max_length, policy = data.draw(st.integers(1, 48)), data.draw(policies)
    with written(name, content) as path:
        pairs = records_or_error(lambda: read_preference_pairs([str(path)], small_tokenizer, max_length, **policy))
        records_or_error(lambda: read_unpaired_examples([str(path)], small_tokenizer, max_length, **policy))
    for pair in pairs or []:  # what reaches training is finite
        assert pair.margin is None or math.isfinite(pair.margin)
        assert len(pair.chosen.input_ids) <= max_length and len(pair.rejected.input_ids) <= max_length


# -- curation readers: WARC and the rest


def warc_file(gz: bool) -> bytes:
    """Three pages (HTML, a PNG, windows-1252 HTML) after a warcinfo record, the same bytes every run."""
    from tests.curate.warc_fixtures import MIXED_PAGES, fixed_warc

    return fixed_warc(MIXED_PAGES, gzip=gz)


@st.composite
def warc_bytes(draw, gz: bool) -> bytes:
    """Raw bytes, or a small WARC (one gzip member per record) whole or damaged, in the compressed
    bytes or inside a member."""
    from tests.curate.warc_fixtures import record_offsets

    how = draw(st.integers(0, 5))
    if how == 0:
        return draw(st.binary(max_size=300))
    data = WARCS[gz]
    if gz and how == 1:  # damage inside one member, which stays a whole gzip member
        with written("a.warc.gz", data) as path:
            starts = [*record_offsets(path), len(data)]
        k = draw(st.integers(0, len(starts) - 2))
        member = gzip.decompress(data[starts[k]:starts[k + 1]])
        return data[:starts[k]] + gzip.compress(draw(damaged(member)), mtime=0) + data[starts[k + 1]:]
    return draw(damaged(data))


WARCS = {gz: warc_file(gz) for gz in (False, True)}
CURATE_NAMES = ["a.warc", "a.warc.gz", "a.html", "a.jsonl", "a.jsonl.gz", "a.txt", "a.parquet"]


@st.composite
def curate_input(draw) -> tuple[str, bytes]:
    name = draw(st.sampled_from(CURATE_NAMES))
    if name.endswith((".warc", ".warc.gz")):
        return name, draw(warc_bytes(name.endswith(".gz")))
    if name.endswith(".parquet"):
        return name, draw(parquet_bytes(("text", "id", "url")))
    if name.endswith(".jsonl.gz"):
        return name, draw(gzip_bytes(jsonl_bytes(document_records)))
    if name.endswith(".jsonl"):
        return name, draw(jsonl_bytes(document_records))
    return name, draw(st.binary(max_size=300))


def read_curate_input(path: Path, records_per_shard: int) -> list:
    from lmforge.curate.readers import InputsConfig, plan_shards, read_piece

    cfg = InputsConfig(paths=[str(path)], records_per_shard=records_per_shard)
    items = [item for shard in plan_shards(cfg) for piece in shard for item in read_piece(piece, cfg)]
    for doc, reason in items:  # every record is a document, kept or a reject with a reason
        assert isinstance(doc.text, str) and isinstance(doc.id, str) and (reason is None or isinstance(reason, str))
        if reason is None:
            doc.text.encode("utf-8")
    return items


@fuzz(250)
@given(item=curate_input(), records_per_shard=st.integers(0, 3))
def test_curate_inputs_are_records_and_rejects_or_an_input_error(item, records_per_shard):
    name, content = item
    with written(name, content) as path:
        records_or_error(lambda: read_curate_input(path, records_per_shard))


# -- recipes: YAML and dotted overrides


def recipe_classes() -> list[type]:
    from lmforge.curate.pipeline import CurateConfig
    from lmforge.stages.dpo import DPORecipe
    from lmforge.stages.prepare import PrepareRecipe
    from lmforge.stages.pretrain import PretrainRecipe
    from lmforge.stages.sft import SFTRecipe

    return [PrepareRecipe, PretrainRecipe, SFTRecipe, DPORecipe, CurateConfig]


RECIPES = recipe_classes()


def dotted_keys(cls: type) -> list[str]:
    from lmforge.cli.main import recipe_keys

    return [row.key for row in recipe_keys(cls) if row.depth == 0]


KEYS = {cls: dotted_keys(cls) for cls in RECIPES}
yaml_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
yaml_values = st.recursive(yaml_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
TRICKY_YAML = [b"&a [*a]", b"a: &a {b: *a}", b"run_dir: !!python/object:os.system {}", b"---\n---\n", b"- 1",
               b"\xff\xfe", b"train: {max_steps: .inf}", b"train: {max_steps: 1e999}", b"model: {preset: nope}",
               b"data: !!binary aGVsbG8=", b"? [a]\n: 1", b"train:\n  lr: 0x10", b"<<: *undefined",
               b"model: {n_kv_heads: 0}", b"model: {preset: [a]}"]


def nested(key: str, value: Any) -> dict:
    head, _, rest = key.partition(".")
    return {head: nested(rest, value) if rest else value}


@st.composite
def recipe_yaml(draw, cls: type) -> bytes:
    """Raw bytes, a known-tricky document, or YAML setting the recipe's own keys to values of any type."""
    import yaml

    how = draw(st.integers(0, 4))
    if how == 0:
        return draw(st.binary(max_size=100))
    if how == 1:
        return draw(st.sampled_from(TRICKY_YAML))
    doc: dict = {}
    for key in draw(st.lists(st.sampled_from(KEYS[cls]), max_size=4)):
        section = doc
        parts = key.split(".")
        for part in parts[:-1]:
            section = section.setdefault(part, {}) if isinstance(section.get(part, {}), dict) else {}
        section[parts[-1]] = draw(yaml_values)
    if draw(st.booleans()):
        doc[draw(st.text(max_size=8))] = draw(yaml_values)
    return yaml.safe_dump(doc, allow_unicode=draw(st.booleans())).encode("utf-8", "surrogatepass")


override_values = st.one_of(st.text(max_size=12), st.sampled_from(["null", "[1, 2", "{a: 1}", "nan", "-inf", "1e999",
                                                                   "true", "0x1f", "''", "[]", "&a [*a]", "~"]))


@st.composite
def overrides(draw, cls: type) -> list[str]:
    key = st.one_of(st.sampled_from(KEYS[cls]), st.text(max_size=10))
    item = st.one_of(st.builds(lambda k, v: f"{k}={v}", key, override_values), st.text(max_size=20))
    return draw(st.lists(item, max_size=3))


@fuzz(150)
@given(st.data())
def test_recipes_from_any_yaml_and_overrides_load_or_are_a_config_error(data):
    cls = data.draw(st.sampled_from(RECIPES))
    text, items = data.draw(recipe_yaml(cls)), data.draw(overrides(cls))
    with written("recipe.yaml", text) as path:
        records_or_error(lambda: load_config(cls, path, items), ConfigError)


@pytest.mark.parametrize("text", TRICKY_YAML)
def test_each_tricky_recipe_document_loads_or_is_a_config_error(text):
    with written("recipe.yaml", text) as path:
        for cls in RECIPES:
            records_or_error(lambda cls=cls: load_config(cls, path, []), ConfigError)


BOUNDARY_VALUES = ["0", "-1", "1e999", "nan", "-inf", "99999999999999999999999", "0.5", "''", "[]", "{}", "null"]


@pytest.mark.parametrize("cls", RECIPES, ids=lambda cls: cls.__name__)
def test_every_recipe_key_at_a_boundary_value_loads_or_is_a_config_error(cls):
    for key in KEYS[cls]:
        for value in BOUNDARY_VALUES:
            records_or_error(lambda key=key, value=value: load_config(cls, None, [f"{key}={value}"]), ConfigError)
