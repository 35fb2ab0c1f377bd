import os
import random

import pytest

from lmforge.core.io import InputError
from lmforge.data.documents import DocumentsConfig, SkipLog, id_hash, read_documents, split_of
from lmforge.data.split import files_split, source_split, train_count, validation_files
from tests.conftest import write_jsonl


def labelled(paths, rule, fraction, **kw):
    cfg = DocumentsConfig(paths=[str(p) for p in paths], **kw)
    return [(split, doc.source, doc.id, doc.text) for split, doc in source_split(cfg, rule, fraction, SkipLog())]


def test_the_hash_rule_is_split_of_over_every_document_in_order(tmp_path, corpus_texts):
    a = write_jsonl(tmp_path / "a.jsonl", [{"id": f"a{i}", "text": t} for i, t in enumerate(corpus_texts)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"id": f"b{i}", "text": t} for i, t in enumerate(corpus_texts[:7])])
    docs = list(read_documents(DocumentsConfig(paths=[str(a), str(b)])))
    assert labelled([a, b], "hash", 0.2) == [(split_of(d.id, 0.2), d.source, d.id, d.text) for d in docs]


def test_source_tail_of_a_text_file_is_nanogpts_last_tenth_by_characters(tmp_path):
    # nanoGPT data/shakespeare_char/prepare.py: train_data = data[:int(n*0.9)]; val_data = data[int(n*0.9):]
    data = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 7 + "Ω end"
    (tmp_path / "input.txt").write_text(data, encoding="utf-8")
    n = len(data)
    assert labelled([tmp_path / "input.txt"], "source_tail", 0.1) == [
        ("train", str(tmp_path / "input.txt"), "input.txt", data[: int(n * 0.9)]),
        ("val", str(tmp_path / "input.txt"), "input.txt", data[int(n * 0.9):]),
    ]


def test_source_tail_sends_the_last_documents_of_each_file_to_val(tmp_path, corpus_texts):
    big = write_jsonl(tmp_path / "big.jsonl", [{"text": t} for t in corpus_texts[:30]])
    small = write_jsonl(tmp_path / "small.jsonl", [{"text": t} for t in corpus_texts[30:33]])
    out = labelled([big, small], "source_tail", 0.1)
    assert [s for s, src, _, _ in out if src == str(big)] == ["train"] * 27 + ["val"] * 3
    assert [s for s, src, _, _ in out if src == str(small)] == ["train"] * 2 + ["val"]  # a small file is represented
    assert [t for *_, t in out] == corpus_texts[:33]  # nothing cut, nothing reordered


def test_train_count_is_int_of_n_times_one_minus_the_fraction():
    assert [train_count(n, 0.1) for n in (1, 9, 10, 11, 1115394)] == [0, 8, 9, 9, int(1115394 * 0.9)]
    assert train_count(2, 0.5) == 1 and train_count(3, 0.05) == 2


def test_source_hash_gives_each_file_the_share_of_smallest_id_hashes_whatever_its_order(tmp_path, corpus_texts):
    records = [{"id": f"x{i}", "text": t} for i, t in enumerate(corpus_texts[:40])]
    tiny = write_jsonl(tmp_path / "tiny.jsonl", [{"id": "t0", "text": "one"}, {"id": "t1", "text": "two"},
                                                 {"id": "t2", "text": "three"}])
    a = write_jsonl(tmp_path / "a.jsonl", records)
    shuffled = records[:]
    random.Random(0).shuffle(shuffled)
    b = write_jsonl(tmp_path / "b.jsonl", shuffled)
    val_a = {i for s, _, i, _ in labelled([a, tiny], "source_hash", 0.1) if s == "val"}
    val_b = {i for s, _, i, _ in labelled([b], "source_hash", 0.1) if s == "val"}
    smallest = sorted((r["id"] for r in records), key=id_hash)[:4]
    assert val_a - {"t0", "t1", "t2"} == val_b == set(smallest)
    assert len(val_a & {"t0", "t1", "t2"}) == 1  # the hash rule might give a three-document file nothing


def test_per_source_rules_count_skipped_records_once(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "a"}\n{"text": broken}\n{"text": "b"}\n{"text": "c"}\n')
    for rule in ("source_tail", "source_hash"):
        skipped = SkipLog()
        cfg = DocumentsConfig(paths=[str(p)], skip_bad_records=True)
        assert len(list(source_split(cfg, rule, 0.3, skipped))) == 3 and skipped.total == 1


def test_validation_files_that_are_missing_empty_or_also_train_inputs_are_errors(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "t"}])
    val = write_jsonl(tmp_path / "val.jsonl", [{"text": "v"}])
    assert validation_files([str(val)], [str(train)]) == [val]
    with pytest.raises(InputError, match=r"val_paths\) path .*missing\.jsonl' matches no file"):
        validation_files([str(tmp_path / "missing.jsonl")], [str(train)])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(InputError, match=r"empty\.txt: the validation file is empty"):
        validation_files([str(tmp_path / "empty.txt")], [str(train)])
    with pytest.raises(InputError, match=r"train\.jsonl: the validation file is also a train input"):
        validation_files([str(tmp_path / "*.jsonl")], [str(train)])
    os.symlink(train, tmp_path / "link.jsonl")  # the same file by another name
    with pytest.raises(InputError, match=r"link\.jsonl: the validation file is also a train input \(.*train\.jsonl"):
        validation_files([str(tmp_path / "link.jsonl")], [str(train)])


def test_files_split_sends_validation_files_to_val_as_read_and_every_train_input_to_train(tmp_path, corpus_texts):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in corpus_texts[:20]])
    (tmp_path / "val.txt").write_text("a held-out text, used as it is")
    cfg = DocumentsConfig(paths=[str(train)])
    out = [(s, d.text) for s, d in files_split(cfg, [tmp_path / "val.txt"], SkipLog())]
    assert out == [("val", "a held-out text, used as it is")] + [("train", t) for t in corpus_texts[:20]]


def test_a_validation_file_without_documents_is_an_error(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "t"}])
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match=r"blank\.jsonl: the validation file holds no documents"):
        list(files_split(DocumentsConfig(paths=[str(train)]), [tmp_path / "blank.jsonl"], SkipLog()))
