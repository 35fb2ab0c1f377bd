"""Reading token shards back: the manifest's structure is checked, and with ``verify`` every
shard's bytes are hashed against the digests the writer recorded."""

import json
import logging
import re
import shutil

import numpy as np
import pytest

from lmforge.core.io import InputError, sha256_file
from lmforge.data.documents import DocumentsConfig
from lmforge.data.loader import DatasetSource, LoaderConfig, TokenLoader
from lmforge.data.shards import open_shards, read_manifest
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from tests.conftest import write_jsonl


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, small_tokenizer_dir, corpus_texts):
    root = tmp_path_factory.mktemp("shards")
    docs = write_jsonl(root / "docs.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(corpus_texts)])
    run_prepare(PrepareRecipe(run_dir=str(root / "data"), tokenizer=str(small_tokenizer_dir),
                              data=DocumentsConfig(paths=[str(docs)]), val_fraction=0.1, shard_tokens=4000))
    return root / "data"


@pytest.fixture()
def data(prepared, tmp_path):
    """A fresh copy of the prepared directory, free to damage."""
    return shutil.copytree(prepared, tmp_path / "data")


def flip_byte(path, offset=-7):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def edit_manifest(data, edit):
    manifest = json.loads((data / "manifest.json").read_text())
    edit(manifest)
    (data / "manifest.json").write_text(json.dumps(manifest))


def test_the_manifest_records_the_sha256_of_each_token_file_and_document_index(prepared):
    shards = read_manifest(prepared)["splits"]["train"]["shards"]
    assert len(shards) > 1
    for info in shards:
        assert info["sha256"] == sha256_file(prepared / info["tokens"])
        assert info["docs_sha256"] == sha256_file(prepared / info["docs"])


def test_verify_names_a_token_shard_changed_in_place_with_the_expected_and_found_digest(data):
    f = data / "train-00001.tokens.npy"
    expected = read_manifest(data)["splits"]["train"]["shards"][1]["sha256"]
    flip_byte(f)  # same size: the size checks cannot see it
    open_shards(data, "train")  # without verify only sizes are checked
    with pytest.raises(InputError) as err:
        open_shards(data, "train", verify=True)
    message = str(err.value)
    assert message.startswith(f"{f}: sha256 {sha256_file(f)} does not match {expected}")
    assert "manifest.json" in message and "\n" not in message


def test_verify_names_a_document_index_changed_in_place(data):
    f = data / "val-00000.docs.npy"
    flip_byte(f, offset=-16)  # the low byte of the last document's start: still a well-formed index
    open_shards(data, "val")
    with pytest.raises(InputError, match=re.escape(str(f))):
        open_shards(data, "val", verify=True)


def test_a_document_index_out_of_order_is_an_error_without_verify(data):
    f = data / "train-00000.docs.npy"
    starts = np.load(f)
    starts[1], starts[2] = starts[2], starts[1]
    np.save(f, starts)
    with pytest.raises(InputError, match=re.escape(f"{f}: document index does not match its token file")):
        open_shards(data, "train")


def test_a_manifest_written_before_docs_sha256_still_opens_and_verifies_its_token_files(data):
    edit_manifest(data, lambda m: [s.pop("docs_sha256") for s in m["splits"]["train"]["shards"]])
    assert len(open_shards(data, "train", verify=True)) > 1
    flip_byte(data / "train-00000.tokens.npy")
    with pytest.raises(InputError, match="train-00000.tokens.npy: sha256"):
        open_shards(data, "train", verify=True)


def test_verify_logs_how_many_shards_and_bytes_it_hashes(data, caplog):
    shards = read_manifest(data)["splits"]["train"]["shards"]
    size = sum((data / s[k]).stat().st_size for s in shards for k in ("tokens", "docs"))
    with caplog.at_level(logging.INFO, logger="lmforge"):
        open_shards(data, "train", verify=True)
    assert f"verifying {len(shards)} train shards ({size / 1e9:.2f} GB)" in caplog.text


def test_the_loaders_verify_shards_option_hashes_the_shards(data):
    flip_byte(data / "train-00000.tokens.npy")
    cfg = LoaderConfig(datasets=[DatasetSource(str(data))], seq_len=32)
    TokenLoader(cfg, 4)  # off by default: a fresh run does not pay for hashing
    cfg.verify_shards = True
    with pytest.raises(InputError, match="train-00000.tokens.npy: sha256"):
        TokenLoader(cfg, 4)


def _shard(m, i=0):
    return m["splits"]["train"]["shards"][i]


DAMAGED_MANIFESTS = {
    "n_tokens a string": (lambda m: m["splits"]["train"].update(n_tokens="12"), r"splits\.train\.n_tokens is '12', not a count"),
    "n_docs negative": (lambda m: m["splits"]["val"].update(n_docs=-1), r"splits\.val\.n_docs is -1, not a count"),
    "splits missing": (lambda m: m.pop("splits"), "splits is missing or not a mapping"),
    "a split missing": (lambda m: m["splits"].pop("val"), r"splits\.val is missing"),
    "shards not a list": (lambda m: m["splits"]["train"].update(shards={}), r"splits\.train\.shards is missing or not a list"),
    "a shard not a mapping": (lambda m: m["splits"]["train"]["shards"].__setitem__(0, "x"), r"shards\[0\] is not a mapping"),
    "a shard without its token file": (lambda m: _shard(m).pop("tokens"), r"shards\[0\]\.tokens is None, not a file name"),
    "a shard without its sha256": (lambda m: _shard(m, 1).pop("sha256"), r"shards\[1\]\.sha256 is None, not a sha256"),
    "a shard's n_docs a float": (lambda m: _shard(m).update(n_docs=3.0), r"shards\[0\]\.n_docs is 3\.0, not a count"),
    "a shard outside the directory": (lambda m: _shard(m).update(tokens="../x.npy"), r"shards\[0\]\.tokens is '\.\./x\.npy'"),
    "counts that disagree with the shards": (lambda m: m["splits"]["train"].update(n_tokens=1),
                                             r"splits\.train\.n_tokens is 1 but its shards hold \d+"),
    "dtype unknown": (lambda m: m.update(dtype="float16"), "dtype 'float16' is not uint16 or uint32"),
    "dtype missing": (lambda m: m.pop("dtype"), "dtype None is not uint16 or uint32"),
    "tokenizer hash missing": (lambda m: m.pop("tokenizer_sha256"), "tokenizer_sha256 is missing"),
    "unigram entropy a string": (lambda m: m["splits"]["train"].update(unigram_entropy="x"), "unigram_entropy is 'x'"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_MANIFESTS))
def test_a_damaged_manifest_is_an_input_error_naming_the_file_and_the_key(data, damage):
    edit, expected = DAMAGED_MANIFESTS[damage]
    edit_manifest(data, edit)
    for read in (read_manifest, open_shards, lambda d: TokenLoader(LoaderConfig([DatasetSource(str(d))], seq_len=32), 4)):
        with pytest.raises(InputError, match=f"^{re.escape(str(data / 'manifest.json'))}: .*{expected}"):
            read(data)


def test_a_truncated_manifest_is_an_input_error_naming_it(data):
    f = data / "manifest.json"
    f.write_text(f.read_text()[:200])
    with pytest.raises(InputError, match=f"^{re.escape(str(f))}: not valid JSON"):
        open_shards(data)


@pytest.mark.parametrize("body", ["[]", '"text"', "null", '{"format": "lmforge-token-shards"}'])
def test_a_manifest_that_is_not_an_object_of_this_format_is_named(data, body):
    (data / "manifest.json").write_text(body)
    with pytest.raises(InputError, match=f"^{re.escape(str(data / 'manifest.json'))}: not an lmforge token-shard"):
        read_manifest(data)


def test_a_listed_shard_that_does_not_exist_is_named_with_the_manifest(data):
    (data / "val-00000.docs.npy").unlink()
    with pytest.raises(InputError, match=f"^{re.escape(str(data / 'manifest.json'))}: lists shard file "
                                         "val-00000.docs.npy of split 'val', which is not in"):
        open_shards(data, "val")
