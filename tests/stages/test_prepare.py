import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.core.io import InputError
from lmforge.data.documents import DocumentsConfig, split_of
from lmforge.data.shards import open_shards, read_manifest, token_dtype
from lmforge.stages.prepare import PrepareRecipe, run_prepare
from tests.conftest import write_jsonl


def prepare(tmp_path, tok_dir, paths, name="out", **kw):
    data_kw = {k: kw.pop(k) for k in list(kw) if k in ("skip_bad_records", "text_field")}
    recipe = PrepareRecipe(run_dir=str(tmp_path / name), tokenizer=str(tok_dir),
                           data=DocumentsConfig(paths=[str(p) for p in paths], **data_kw), **kw)
    return run_prepare(recipe), tmp_path / name


def test_same_inputs_give_byte_identical_shards(tmp_path, small_tokenizer_dir, corpus_jsonl):
    _, a = prepare(tmp_path, small_tokenizer_dir, [corpus_jsonl], "a", shard_tokens=3000, batch_docs=7)
    _, b = prepare(tmp_path, small_tokenizer_dir, [corpus_jsonl], "b", shard_tokens=3000, batch_docs=7)
    files = sorted(p.name for p in a.iterdir() if p.name.endswith(".npy")) + ["manifest.json"]
    assert len(files) > 4  # several shards per split
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_each_stored_document_is_bos_tokens_eos(tmp_path, small_tokenizer, small_tokenizer_dir, corpus_texts, corpus_jsonl):
    manifest, out = prepare(tmp_path, small_tokenizer_dir, [corpus_jsonl], shard_tokens=4000, val_fraction=0.2)
    expected = {"train": [], "val": []}
    for i, text in enumerate(corpus_texts):
        expected[split_of(f"doc{i}", 0.2)].append([0, *small_tokenizer.encode(text), 1])
    for split in ("train", "val"):
        stored = []
        for shard in open_shards(out, split):
            starts = shard.doc_starts
            stored += [shard.tokens[starts[j] : starts[j + 1]].tolist() for j in range(len(starts) - 1)]
        assert stored == expected[split]
        assert manifest["splits"][split]["n_docs"] == len(expected[split])
    assert manifest["dtype"] == "uint16" and manifest["tokenizer_sha256"] == small_tokenizer.sha256
    assert manifest["n_tokens"] == sum(len(d) for s in expected.values() for d in s)
    assert manifest["sources"] == [{"path": str(corpus_jsonl), "n_docs": len(corpus_texts), "val_docs": len(expected["val"])}]
    assert manifest["split"] == {"rule": "hash", "val_fraction": 0.2}


def test_the_manifest_records_each_splits_unigram_entropy_and_pretrain_reads_it(tmp_path, small_tokenizer_dir,
                                                                                corpus_jsonl, monkeypatch):
    from lmforge.stages import pretrain

    manifest, out = prepare(tmp_path, small_tokenizer_dir, [corpus_jsonl], shard_tokens=3000, val_fraction=0.2)
    vocab = 512
    for split in ("train", "val"):
        tokens = np.concatenate([shard.tokens for shard in open_shards(out, split)])
        p = np.bincount(tokens, minlength=vocab) / len(tokens)
        p = p[p > 0]
        assert len(open_shards(out, split)) > 1  # counted over every shard of the split
        assert manifest["splits"][split]["unigram_entropy"] == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)
    expected = manifest["splits"]["train"]["unigram_entropy"]
    monkeypatch.setattr(pretrain, "open_shards", lambda *a, **k: pytest.fail("the recorded entropy is read, not recounted"))
    assert pretrain.unigram_entropy(out, vocab) == expected
    # shards prepared before the manifest recorded it are counted
    monkeypatch.undo()
    del manifest["splits"]["train"]["unigram_entropy"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert pretrain.unigram_entropy(out, vocab) == pytest.approx(expected, rel=1e-12)


def test_token_dtype_widens_past_65536():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_jsonl_parquet_and_text_inputs_are_all_read(tmp_path, small_tokenizer_dir):
    j = write_jsonl(tmp_path / "a.jsonl", [{"id": "j", "text": "from jsonl"}])
    pq.write_table(pa.table({"id": ["p"], "text": ["from parquet"]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("from text")
    manifest, _ = prepare(tmp_path, small_tokenizer_dir, [j, tmp_path / "b.parquet", tmp_path / "c.txt"], val_fraction=0.0)
    assert manifest["n_docs"] == 3 and [s["n_docs"] for s in manifest["sources"]] == [1, 1, 1]


def test_malformed_line_is_an_error_naming_file_and_line_and_leaves_no_output(tmp_path, small_tokenizer_dir):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": broken}\n')
    with pytest.raises(InputError, match=r"bad\.jsonl:3: malformed JSON"):
        prepare(tmp_path, small_tokenizer_dir, [p])
    assert not (tmp_path / "out").exists()


def test_skipped_records_are_counted_in_the_manifest(tmp_path, small_tokenizer_dir):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"text": "fine"}\n{"text": broken}\n{"txt": "x"}\n{"text": "\xff"}\n{"text": "also fine"}\n')
    manifest, out = prepare(tmp_path, small_tokenizer_dir, [p], skip_bad_records=True, val_fraction=0.0)
    assert manifest["n_docs"] == 2
    assert manifest["skipped"]["by_reason"] == {"invalid_utf8": 1, "malformed_json": 1, "missing_text": 1}
    assert json.loads((out / "manifest.json").read_text())["skipped"]["total"] == 3


def test_empty_input_is_an_error_that_says_so(tmp_path, small_tokenizer_dir):
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    with pytest.raises(InputError, match="the input is empty"):
        prepare(tmp_path, small_tokenizer_dir, [p])


def test_rerun_replaces_the_previous_output(tmp_path, small_tokenizer_dir):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "first run"}])
    prepare(tmp_path, small_tokenizer_dir, [a], val_fraction=0.0)
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": "second"}, {"text": "run"}])
    prepare(tmp_path, small_tokenizer_dir, [b], val_fraction=0.0)
    assert read_manifest(tmp_path / "out")["n_docs"] == 2


def test_a_truncated_shard_is_detected(tmp_path, small_tokenizer_dir, corpus_jsonl):
    _, out = prepare(tmp_path, small_tokenizer_dir, [corpus_jsonl])
    f = out / "train-00000.tokens.npy"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(InputError, match="train-00000.tokens.npy"):
        open_shards(out, "train")


def test_the_temporary_output_of_a_killed_prepare_is_removed_at_the_next_start(tmp_path, small_tokenizer_dir):
    from lmforge.core.io import temporary_directory

    leftover = temporary_directory(tmp_path / "out")  # what atomic_directory leaves when its process dies
    (leftover / "part.bin").write_bytes(b"half")
    other = temporary_directory(tmp_path / "out.v2")  # another output's: not this run's to remove
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "a run"}])
    prepare(tmp_path, small_tokenizer_dir, [a], val_fraction=0.0)
    assert not leftover.exists() and other.exists()
    assert read_manifest(tmp_path / "out")["n_docs"] == 1


def test_an_empty_validation_split_is_warned_about(tmp_path, small_tokenizer_dir, corpus_texts, caplog):
    import logging

    from lmforge.core.run import log

    train_only = [f"doc{i}" for i in range(200) if split_of(f"doc{i}", 0.05) == "train"][:9]
    p = write_jsonl(tmp_path / "nine.jsonl", [{"id": i, "text": t} for i, t in zip(train_only, corpus_texts)])
    log.addHandler(caplog.handler)  # the lmforge logger does not propagate to the root logger
    try:
        with caplog.at_level(logging.WARNING, logger="lmforge"):
            manifest, _ = prepare(tmp_path, small_tokenizer_dir, [p], val_fraction=0.05)
    finally:
        log.removeHandler(caplog.handler)
    assert manifest["splits"]["val"]["n_docs"] == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("validation split is empty: none of the 9 documents hashed into val_fraction=0.05" in w for w in warnings)


def stored_documents(out, split):
    docs = []
    for shard in open_shards(out, split):
        starts = shard.doc_starts
        docs += [shard.tokens[starts[j] : starts[j + 1]].tolist() for j in range(len(starts) - 1)]
    return docs


def test_source_tail_holds_out_the_last_tenth_of_a_text_as_nanogpt_does(tmp_path, small_tokenizer, small_tokenizer_dir,
                                                                         corpus_texts, corpus_jsonl):
    text = tmp_path / "input.txt"
    data = "\n".join(corpus_texts[:5])
    text.write_text(data, encoding="utf-8")
    manifest, out = prepare(tmp_path, small_tokenizer_dir, [text, corpus_jsonl], split="source_tail", val_fraction=0.1)
    cut = int(len(data) * 0.9)  # nanoGPT's shakespeare_char: data[:int(n*0.9)] trains
    n = len(corpus_texts)
    encode = small_tokenizer.encode
    assert stored_documents(out, "train") == [[0, *encode(data[:cut]), 1]] + [[0, *encode(t), 1]
                                                                              for t in corpus_texts[: int(n * 0.9)]]
    assert stored_documents(out, "val") == [[0, *encode(data[cut:]), 1]] + [[0, *encode(t), 1]
                                                                            for t in corpus_texts[int(n * 0.9):]]
    assert manifest["split"] == {"rule": "source_tail", "val_fraction": 0.1}
    assert manifest["sources"] == [{"path": str(text), "n_docs": 2, "val_docs": 1},
                                   {"path": str(corpus_jsonl), "n_docs": n, "val_docs": n - int(n * 0.9)}]


def test_source_hash_gives_a_small_file_its_share_of_val(tmp_path, small_tokenizer_dir, corpus_texts, corpus_jsonl):
    # three documents that the global hash rule sends all to train
    ids = [f"doc{i}" for i in range(200) if split_of(f"doc{i}", 0.05) == "train"][:3]
    small = write_jsonl(tmp_path / "small.jsonl", [{"id": i, "text": t} for i, t in zip(ids, corpus_texts)])
    hashed, _ = prepare(tmp_path, small_tokenizer_dir, [corpus_jsonl, small], "hashed", val_fraction=0.05)
    per_source, _ = prepare(tmp_path, small_tokenizer_dir, [corpus_jsonl, small], "per_source", split="source_hash",
                            val_fraction=0.05)
    assert [s["val_docs"] for s in per_source["sources"]] == [len(corpus_texts) - int(len(corpus_texts) * 0.95), 1]
    assert per_source["split"] == {"rule": "source_hash", "val_fraction": 0.05}
    assert hashed["sources"][1]["val_docs"] == 0


def test_val_paths_are_the_validation_split_as_they_are_read(tmp_path, small_tokenizer, small_tokenizer_dir,
                                                              corpus_texts, corpus_jsonl):
    held_out = write_jsonl(tmp_path / "held_out.jsonl", [{"text": "a held-out sentence"}, {"text": "and another"}])
    manifest, out = prepare(tmp_path, small_tokenizer_dir, [corpus_jsonl], val_paths=[str(held_out)])
    encode = small_tokenizer.encode
    assert stored_documents(out, "val") == [[0, *encode("a held-out sentence"), 1], [0, *encode("and another"), 1]]
    assert stored_documents(out, "train") == [[0, *encode(t), 1] for t in corpus_texts]  # none hashed away
    assert manifest["split"] == {"rule": "files", "val_paths": [str(held_out)]} and manifest["val_fraction"] is None
    assert manifest["sources"][0] == {"path": str(held_out), "n_docs": 2, "val_docs": 2}


def test_a_validation_file_that_is_a_train_input_or_empty_is_an_error_and_leaves_no_output(tmp_path, small_tokenizer_dir,
                                                                                           corpus_jsonl):
    with pytest.raises(InputError, match="the validation file is also a train input"):
        prepare(tmp_path, small_tokenizer_dir, [corpus_jsonl], val_paths=[str(corpus_jsonl)])
    (tmp_path / "blank.jsonl").write_text("\n")
    with pytest.raises(InputError, match="blank.jsonl: the validation file holds no documents"):
        prepare(tmp_path, small_tokenizer_dir, [corpus_jsonl], val_paths=[str(tmp_path / "blank.jsonl")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("override, message", [
    (["split=source_tail", "val_fraction=0"], r"val_fraction must be in \(0, 1\) for split=source_tail"),
    (["split=source_hash", "val_fraction=1"], r"val_fraction"),
    (["split=source_hash", "val_paths=[v.jsonl]"], "val_paths and split=source_hash cannot be combined"),
    (["split=tail"], "'split' must be one of 'hash', 'source_hash', 'source_tail'"),
])
def test_split_options_that_make_no_sense_are_config_errors(override, message):
    from lmforge.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(PrepareRecipe, None, override)


def test_a_file_that_goes_wholly_to_val_under_source_hash_is_warned_about(tmp_path, small_tokenizer_dir, corpus_jsonl,
                                                                          caplog):
    import logging

    from lmforge.core.run import log

    (tmp_path / "one.txt").write_text("a file of a single document")
    log.addHandler(caplog.handler)  # the lmforge logger does not propagate to the root logger
    try:
        with caplog.at_level(logging.WARNING, logger="lmforge"):
            manifest, _ = prepare(tmp_path, small_tokenizer_dir, [corpus_jsonl, tmp_path / "one.txt"],
                                  split="source_hash", val_fraction=0.1)
    finally:
        log.removeHandler(caplog.handler)
    assert manifest["sources"][1] == {"path": str(tmp_path / "one.txt"), "n_docs": 1, "val_docs": 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"all 1 documents of {tmp_path / 'one.txt'} went to the validation split" in w
               and "source_tail cuts a one-document file" in w for w in warnings)


def test_conversations_are_tokenized_as_sft_tokenizes_them_with_their_special_tokens(tmp_path, small_tokenizer,
                                                                                       small_tokenizer_dir):
    from lmforge.data.chat import tokenize_segments
    from lmforge.data.chatml import IM_END, IM_START, render_chatml

    chats = [[{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": str(2 * i)}]
             for i in range(40)]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    data = DocumentsConfig(paths=[str(path)], messages_field="messages")
    manifest = run_prepare(PrepareRecipe(run_dir=str(tmp_path / "out"), tokenizer=str(small_tokenizer_dir), data=data,
                                         val_fraction=0.0))
    shard, = open_shards(tmp_path / "out", "train")
    starts = shard.doc_starts
    stored = [shard.tokens[starts[j] : starts[j + 1]].tolist() for j in range(len(starts) - 1)]
    # SFT's ids of the same conversation (BOS + the ChatML text), then prepare's EOS
    assert stored == [tokenize_segments(small_tokenizer, render_chatml(m))[0] + [small_tokenizer.eos_id] for m in chats]
    im_start, im_end = small_tokenizer.token_to_id(IM_START), small_tokenizer.token_to_id(IM_END)
    assert all(d.count(im_start) == 2 and d.count(im_end) == 2 for d in stored)  # one special token each, not split
    assert manifest["splits"]["train"]["n_docs"] == 40


def test_a_run_dir_that_is_a_file_is_refused_before_any_work_and_the_file_is_kept(tmp_path, small_tokenizer_dir,
                                                                                  corpus_jsonl, capsys, monkeypatch):
    from lmforge.cli.main import main
    from lmforge.core.io import is_temporary
    from lmforge.stages import prepare as stage

    (tmp_path / "notes.txt").write_text("the user's own file")
    argv = ["prepare", f"data.paths=[{corpus_jsonl}]", f"tokenizer={small_tokenizer_dir}", f"run_dir={tmp_path}/notes.txt"]
    monkeypatch.setattr(stage.Tokenizer, "load", lambda *a: pytest.fail("the run_dir is checked before any work"))
    for _ in range(2):  # a second prepare finds the file as it was, not a "temporary" to remove
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("lmforge prepare: error: run_dir = ")
        assert "notes.txt: exists and is not a folder" in err[0]
        assert (tmp_path / "notes.txt").read_text() == "the user's own file"
        assert not [p for p in tmp_path.iterdir() if is_temporary(p)]


def test_a_run_dir_that_is_a_link_is_refused_and_the_link_kept(tmp_path, small_tokenizer_dir, corpus_jsonl):
    (tmp_path / "real").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "real")
    with pytest.raises(InputError, match=r"run_dir = .*out: is a link"):
        prepare(tmp_path, small_tokenizer_dir, [corpus_jsonl])
    assert (tmp_path / "out").is_symlink() and list((tmp_path / "real").iterdir()) == []


def test_prepare_holds_the_run_dir_lock_and_a_second_prepare_into_it_is_refused(tmp_path, small_tokenizer_dir,
                                                                                corpus_jsonl, monkeypatch):
    from lmforge.core.run import LOCK_FILE, RunDirBusy
    from lmforge.stages import prepare as stage
    from tests.core.test_run import hold_in_subprocess

    prepare(tmp_path, small_tokenizer_dir, [corpus_jsonl])
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    holder = hold_in_subprocess(tmp_path / "out")
    try:
        monkeypatch.setattr(stage.Tokenizer, "load", lambda *a: pytest.fail("a busy run_dir is refused before any work"))
        with pytest.raises(RunDirBusy, match=rf"pid {holder.pid} on "):
            prepare(tmp_path, small_tokenizer_dir, [corpus_jsonl])
    finally:
        holder.communicate("")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert LOCK_FILE in before  # the lock went with the new contents when prepare replaced its folder
