import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.core.config import ConfigError, load_config
from lmforge.core.io import InputError, file_stamps, named_paths, temporary_directory
from lmforge.curate import filters
from lmforge.curate.pipeline import CurateConfig, run_curate
from lmforge.curate.readers import InputsConfig
from lmforge.curate.records import JsonlWriter
from lmforge.data.documents import DocumentsConfig, read_documents
from tests.curate.warc_fixtures import PROSE, html_record, page, write_warc

STEPS = [{"type": "extract"}, {"type": "language", "languages": ["en"]},
         {"type": "gopher_quality", "min_doc_words": 20}, {"type": "exact_dedup"}]


def story(i: int) -> str:
    return f"Story number {i} begins here. " + PROSE["en"]


@pytest.fixture()
def crawl(tmp_path):
    """12 records: 6 English stories, 2 exact copies, French, a PDF, an undecodable page, and a cut-off last record."""
    records = [html_record(f"https://x.org/en/{i}", story(i)) for i in range(6)]
    records += [html_record("https://x.org/copy/0", story(0)), html_record("https://x.org/copy/3", story(3))]
    records += [html_record("https://x.org/fr/0", PROSE["fr"]),
                ("https://x.org/doc.pdf", b"%PDF-1.4 binary", "application/pdf"),
                ("https://x.org/bad", "<p>caf\xe9</p>".encode("latin-1"), "text/html; charset=utf-8"),
                html_record("https://x.org/en/cut", story(9) * 4)]
    path = write_warc(tmp_path / "crawl.warc.gz", records)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 150])
    (tmp_path / "known.tsv").write_text("url_a\turl_b\tkind\tjaccard\n"
                                        "https://x.org/copy/0\thttps://x.org/en/0\tidentical\t1.0\n"
                                        "https://x.org/copy/3\thttps://x.org/en/3\tidentical\t1.0\n")
    return path


def config(tmp_path, crawl, name="run", **kw):
    return CurateConfig(run_dir=str(tmp_path / name), inputs=InputsConfig(paths=[str(crawl)], records_per_shard=3),
                        steps=[dict(s) for s in STEPS], workers=1, known_duplicates=str(tmp_path / "known.tsv"), **kw)


def outputs(run_dir):
    return {p.relative_to(run_dir).as_posix(): p.read_bytes()
            for d in ("output", "rejects") for p in sorted((run_dir / d).iterdir())}


def rejects(run_dir):
    return [json.loads(line) for p in sorted((run_dir / "rejects").glob("*.jsonl")) for line in p.open()]


def test_kept_plus_rejected_is_the_input_and_every_reject_has_stage_and_reason(tmp_path, crawl):
    stats = run_curate(config(tmp_path, crawl))
    run_dir = tmp_path / "run"
    kept = list(read_documents(DocumentsConfig(paths=[str(run_dir / "output" / "*.parquet")])))
    rej = rejects(run_dir)
    assert len(kept) + len(rej) == 12 == stats["documents"] and stats["input_shards"] == 4
    assert len({d.id for d in kept}) == len(kept)  # WARC record ids
    assert len(kept) == 6 == stats["kept"]
    by_url = {r["metadata"].get("url"): (r["stage"], r["reason"].split(":")[0].split(" ")[0]) for r in rej}
    assert by_url == {"https://x.org/copy/0": ("exact_dedup", "exact-duplicate"),
                      "https://x.org/copy/3": ("exact_dedup", "exact-duplicate"),
                      "https://x.org/fr/0": ("language", "language"),
                      "https://x.org/doc.pdf": ("extract", "not-html"),
                      "https://x.org/bad": ("read", "undecodable-payload"),
                      "https://x.org/en/cut": ("read", "truncated-record")}
    assert stats["stages"]["language"]["reasons"] == {"language": 1}
    assert stats["languages"]["kept"] == {"en": 6}
    assert stats["dedup"]["precision"] == 1.0 and stats["dedup"]["recall"] == 1.0
    assert (run_dir / "report.png").stat().st_size > 0 and "kept" in (run_dir / "report.md").read_text()
    assert json.loads((run_dir / "stats.json").read_text())["kept"] == 6
    # rejects are written by JsonlWriter, outputs by core.io: both get the usual permissions, not mkstemp's 0600
    modes = {f.stat().st_mode & 0o777 for f in [*(run_dir / "rejects").iterdir(), *(run_dir / "output").iterdir()]}
    umask = os.umask(0o022)
    os.umask(umask)
    assert modes == {0o666 & ~umask}


def test_interrupted_run_resumes_to_identical_output(tmp_path, crawl, monkeypatch):
    reference = tmp_path / "reference"
    run_curate(config(tmp_path, crawl, "reference"))
    calls = {"n": 0}
    real = filters.GopherQualityFilter.__call__

    def interrupted(self, doc):
        calls["n"] += 1
        if calls["n"] == 4:  # mid-way through the second shard
            raise KeyboardInterrupt
        return real(self, doc)

    monkeypatch.setattr(filters.GopherQualityFilter, "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_curate(config(tmp_path, crawl))
    monkeypatch.setattr(filters.GopherQualityFilter, "__call__", real)
    stats = run_curate(config(tmp_path, crawl))
    assert stats["tasks_skipped"] >= 1  # the finished shard was not redone
    assert outputs(tmp_path / "run") == outputs(reference)
    again = run_curate(config(tmp_path, crawl))
    assert again["tasks_run"] == 0 and outputs(tmp_path / "run") == outputs(reference)


def test_changed_step_reruns_from_that_segment_and_jsonl_output(tmp_path, crawl):
    run_curate(config(tmp_path, crawl))
    cfg = config(tmp_path, crawl, output_format="jsonl")
    cfg.steps[-1]["lowercase"] = True
    stats = run_curate(cfg)
    assert stats["tasks_skipped"] == 5  # segment 0's 4 shards and its ids reused; dedup and output redone
    assert sorted(p.suffix for p in (tmp_path / "run" / "output").iterdir()) == [".jsonl"] * 4


def test_process_pool_and_ray_give_the_same_output_as_one_process(tmp_path, crawl):
    import ray

    run_curate(config(tmp_path, crawl, "one"))
    run_curate(CurateConfig(**{**vars(config(tmp_path, crawl, "pool")), "workers": 2}))
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        run_curate(CurateConfig(**{**vars(config(tmp_path, crawl, "ray")), "executor": "ray", "workers": 2}))
    finally:
        ray.shutdown()
    assert outputs(tmp_path / "pool") == outputs(tmp_path / "one") == outputs(tmp_path / "ray")


def test_recipe_errors_name_the_step_and_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown step type 'gopher_qualty'; did you mean 'gopher_quality'"):
        CurateConfig(steps=[{"type": "gopher_qualty"}])
    with pytest.raises(ConfigError, match=r"steps\[1\]\.min_doc_word'; did you mean 'steps\[1\]\.min_doc_words'"):
        CurateConfig(steps=[{"type": "extract"}, {"type": "gopher_quality", "min_doc_word": 3}])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("inputs: {paths: [a.warc.gz]}\nsteps:\n  - type: language\n    threshold: 0.9\n")
    cfg = load_config(CurateConfig, recipe)
    assert cfg.steps == [{"type": "language", "languages": ["en"], "threshold": 0.9, "max_chars": 0}]


def test_missing_input_is_an_input_error(tmp_path):
    cfg = CurateConfig(run_dir=str(tmp_path / "r"), inputs=InputsConfig(paths=[str(tmp_path / "none.jsonl")]))
    with pytest.raises(InputError, match="none.jsonl"):
        run_curate(cfg)


def test_minhash_removes_copies_whose_ids_collide_across_inputs(tmp_path):
    # FineWeb-like layout: dumps holding files of the same name, with ids "1", "2" in each file,
    # or none, when the fallback ids part.jsonl:<line> collide
    texts = [PROSE["en"], PROSE["fr"]]
    only_unnamed = " ".join(f"token{i}" for i in range(60))
    for dump, with_ids in (("dump-a", True), ("dump-b", True), ("dump-c", False), ("dump-d", False)):
        (tmp_path / dump).mkdir()
        lines = [{"id": str(i + 1), "text": t} for i, t in enumerate(texts)] if with_ids else \
            [{"text": t} for t in [only_unnamed, *texts]]
        (tmp_path / dump / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cfg = CurateConfig(run_dir=str(tmp_path / "run"), inputs=InputsConfig(paths=[str(tmp_path / "dump-*/part.jsonl")]),
                       steps=[{"type": "minhash"}], workers=1, output_format="jsonl")
    stats = run_curate(cfg)
    kept = [json.loads(line) for p in sorted((tmp_path / "run" / "output").iterdir()) for line in p.open()]
    assert [(r["id"], r["metadata"]["source"], r["metadata"]["dup_cluster"], r["metadata"]["dup_cluster_size"])
            for r in kept] == [("1", str(tmp_path / "dump-a" / "part.jsonl"), "1", 4),
                               ("2", str(tmp_path / "dump-a" / "part.jsonl"), "2", 4),
                               ("part.jsonl:1", str(tmp_path / "dump-c" / "part.jsonl"), "part.jsonl:1", 2)]
    assert stats["kept"] == 3 and stats["stages"]["minhash"]["reasons"] == {"near-duplicate": 7}
    assert stats["dup_cluster_sizes"] == {2: 1, 4: 2}


def test_repeated_ids_are_qualified_with_their_file_and_the_report_pairs_the_right_pages(tmp_path):
    # ids 1, 2 in each file (and 1 twice in the second); a repeat keeps its id when the first holder is rejected
    first, second = tmp_path / "dump-a" / "part.jsonl", tmp_path / "dump b" / "part.jsonl"
    story, other = PROSE["en"], PROSE["en"][::-1]
    for path, rows in ((first, [("1", story, "https://a.org/1"), ("2", "spam page", "https://a.org/spam")]),
                       (second, [("1", other, "https://b.org/1"), ("2", story, "https://b.org/2"),
                                 ("1", other, "https://b.org/3")])):
        path.parent.mkdir()
        path.write_text("".join(json.dumps({"id": i, "text": t, "url": u}) + "\n" for i, t, u in rows))
    (tmp_path / "known.tsv").write_text("url_a\turl_b\nhttps://a.org/1\thttps://b.org/2\n"
                                        "https://b.org/1\thttps://b.org/3\n")

    def run(name, records_per_shard):
        cfg = CurateConfig(run_dir=str(tmp_path / name), workers=1, output_format="jsonl",
                           inputs=InputsConfig(paths=[str(first), str(second)], records_per_shard=records_per_shard),
                           steps=[{"type": "url_filter", "banned_words": ["spam"]}, {"type": "exact_dedup"}],
                           known_duplicates=str(tmp_path / "known.tsv"))
        stats = run_curate(cfg)
        kept = [(r["id"], r["metadata"]["url"]) for p in sorted((tmp_path / name / "output").iterdir())
                for r in map(json.loads, p.open())]
        rejected = [(r["id"], r["metadata"]["url"], r["reason"]) for r in rejects(tmp_path / name)]
        return stats, kept, rejected

    stats, kept, rejected = run("run", 2)  # shards: a/1 a/2 | b/1 b/2 | b/3
    assert kept == [("1", "https://a.org/1"), (f"1@{second}#1", "https://b.org/1")]
    assert rejected == [("2", "https://a.org/spam", "hard_blacklisted: 'spam' in URL"),
                        (f"2@{second}#2", "https://b.org/2", "exact-duplicate of 1"),
                        (f"1@{second}#3", "https://b.org/3", f"exact-duplicate of 1@{second}#1")]
    assert stats["dedup"]["predicted_pairs"] == 2 and stats["dedup"]["precision"] == stats["dedup"]["recall"] == 1.0
    assert run("one-shard-per-file", 0)[1:] == (kept, rejected)  # ids depend on the inputs, not on sharding


def test_a_page_fetched_twice_is_not_a_predicted_pair_with_itself(tmp_path):
    # the crawl fetched https://a.org/1 twice; its copies and b.org/2's are one cluster: one pair, not two
    docs = tmp_path / "docs.jsonl"
    rows = [("x", "https://a.org/1"), ("y", "https://a.org/1"), ("z", "https://b.org/2")]
    docs.write_text("".join(json.dumps({"id": i, "text": PROSE["en"], "url": u}) + "\n" for i, u in rows))
    (tmp_path / "known.tsv").write_text("url_a\turl_b\nhttps://a.org/1\thttps://b.org/2\n")
    stats = run_curate(CurateConfig(run_dir=str(tmp_path / "run"), workers=1, inputs=InputsConfig(paths=[str(docs)]),
                                    steps=[{"type": "exact_dedup"}], known_duplicates=str(tmp_path / "known.tsv")))
    assert stats["kept"] == 1
    assert stats["dedup"]["predicted_pairs"] == 1 and stats["dedup"]["precision"] == stats["dedup"]["recall"] == 1.0


def test_extract_changes_only_html_documents(tmp_path):
    code = "Use #include <stdio.h> in C programs\nand compare if a<b.\n\n  Second paragraph <br> here.\n"
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"id": "j", "text": code}) + "\n")
    (tmp_path / "page.html").write_text(page(PROSE["en"]))
    warc = write_warc(tmp_path / "c.warc.gz", [html_record("https://x.org/a", PROSE["en"]),
                                               ("https://x.org/a.txt", code.encode(), "text/plain")])
    cfg = CurateConfig(run_dir=str(tmp_path / "run"), steps=[{"type": "extract"}], workers=1, output_format="jsonl",
                       inputs=InputsConfig(paths=[str(jsonl), str(tmp_path / "page.html"), str(warc)]))
    assert run_curate(cfg)["kept"] == 4
    text = {r["metadata"].get("url", r["id"]): r["text"]
            for p in sorted((tmp_path / "run" / "output").iterdir()) for r in map(json.loads, p.open())}
    assert text["j"] == code and text["https://x.org/a.txt"] == code  # byte for byte
    assert text["https://x.org/a"] == text[(tmp_path / "page.html").as_posix()] == f"Page\n\n{PROSE['en']}"


def test_a_changed_file_named_by_a_step_reruns_that_step_and_the_later_ones(tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(
        json.dumps({"id": f"{host}-{i}", "text": f"page {i} of {host}", "url": f"https://{host}/{i}"}) + "\n"
        for host in ("a.org", "b.org", "c.org") for i in range(2)))
    first, second = tmp_path / "first.txt", tmp_path / "lists" / "second.txt"
    second.parent.mkdir()
    first.write_text("a.org\n")
    second.write_text("# nothing blocked yet\n")
    cfg = CurateConfig(run_dir=str(tmp_path / "run"), inputs=InputsConfig(paths=[str(tmp_path / "docs.jsonl")]),
                       steps=[{"type": "url_filter", "domains_file": str(first)}, {"type": "exact_dedup"},
                              {"type": "url_filter", "name": "second", "domains_file": str(second)}], workers=1)

    def rewrite(path, text, tick):
        path.write_text(text)
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + tick * 10**9))  # not the same mtime

    def rejected():
        return sorted((r["id"], r["stage"]) for r in rejects(tmp_path / "run"))

    assert run_curate(cfg)["kept"] == 4 and rejected() == [("a.org-0", "url_filter"), ("a.org-1", "url_filter")]
    assert run_curate(cfg)["tasks_run"] == 0
    rewrite(second, "c.org\n", 1)  # a later step's file: segment 0 is reused
    stats = run_curate(cfg)
    assert stats["kept"] == 2 and stats["tasks_skipped"] == 2  # segment 0's shard and ids
    assert rejected() == [("a.org-0", "url_filter"), ("a.org-1", "url_filter"), ("c.org-0", "second"),
                          ("c.org-1", "second")]
    rewrite(first, "b.org\n", 2)  # the first step's file, same size: everything reruns
    stats = run_curate(cfg)
    assert stats["kept"] == 2 and stats["tasks_skipped"] == 0
    assert rejected() == [("b.org-0", "url_filter"), ("b.org-1", "url_filter"), ("c.org-0", "second"),
                          ("c.org-1", "second")]


def test_referenced_files_walk_folders_and_ignore_strings_that_are_no_path(tmp_path):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "classifier.npz").write_bytes(b"12")
    (model / "sub" / "config.json").write_text("{}")
    config = {"type": "classifier", "model": str(model), "words": ["the", "", str(tmp_path / "missing")], "n": 3}
    def referenced_files(value):  # what a step's fingerprint stamps besides its config
        return file_stamps(named_paths(value))

    before = referenced_files(config)
    assert [(path, size) for path, size, _ in before] == [(str(model / "classifier.npz"), 2),
                                                          (str(model / "sub" / "config.json"), 2)]
    (model / "sub" / "config.json").write_text("{1}")
    assert referenced_files(config) != before
    (model / "sub" / "extra.json").write_text("")
    assert len(referenced_files(config)) == 3


def test_lone_surrogates_are_read_rejects_and_every_record_is_counted(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_bytes(b'{"id": "a", "text": "first document"}\n{"text": "abc \\ud800 def"}\n'
                      b'{"id": "c", "text": "third", "title": "\\udc80"}\n{"id": "d", "text": "last document"}\n')
    # a declared utf-7 payload decodes to a lone surrogate; the reader falls back to UTF-8
    warc = write_warc(tmp_path / "c.warc.gz", [("https://x.org/7", b"<p>+2AA- seven</p>", "text/html; charset=utf-7")])
    cfg = CurateConfig(run_dir=str(tmp_path / "run"), inputs=InputsConfig(paths=[str(jsonl), str(warc)]),
                       steps=[{"type": "extract"}, {"type": "exact_dedup"}], workers=1, output_format="jsonl")
    stats = run_curate(cfg)
    assert stats["documents"] == 5 == stats["kept"] + stats["rejected"] and stats["kept"] == 3
    assert [(r["id"], r["stage"], r["reason"]) for r in rejects(tmp_path / "run")] == [
        ("d.jsonl:2", "read", f"invalid-unicode: {jsonl}:2: lone surrogate at character 4 of field 'text'"),
        ("c", "read", f"invalid-unicode: {jsonl}:3: lone surrogate at character 0 of field 'title'")]
    kept = [json.loads(line) for p in sorted((tmp_path / "run" / "output").iterdir()) for line in p.open()]
    assert [r["text"] for r in kept] == ["first document", "last document", "+2AA- seven"]


def killed_atomic_write(path):
    """What core.io's atomic_write_bytes leaves when its process dies just before the rename."""
    code = "import os, sys; from lmforge.core import io; os.replace = lambda *a: os._exit(9); " \
           "io.atomic_write_bytes(sys.argv[1], b'partial')"
    assert subprocess.run([sys.executable, "-c", code, str(path)]).returncode == 9
    (leftover,) = path.parent.glob(f".{path.name}.*")
    return leftover


def unfinished_jsonl(path):
    """What a JsonlWriter leaves when its process dies before ``commit``."""
    writer = JsonlWriter(path)
    writer.write({"id": "partial"})
    writer.f.close()
    return Path(writer.tmp)


def unfinished_directory(path):
    """What core.io's atomic_directory leaves when its process dies inside the block."""
    tmp = temporary_directory(path)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "part.npy").write_bytes(b"partial")
    return tmp


def test_a_run_removes_temporary_files_folders_and_work_folders_a_killed_run_left(tmp_path, crawl):
    run_curate(config(tmp_path, crawl, "reference"))
    longer = config(tmp_path, crawl)
    longer.steps.append({"type": "minhash"})  # three segments; the next run's recipe has two
    run_curate(longer)
    run_dir = tmp_path / "run"
    work = run_dir / "work"
    leftovers = [killed_atomic_write(run_dir / "stats.json"),
                 killed_atomic_write(work / "seg-1" / "step" / "index" / "b0003" / "s000002.npy"),
                 killed_atomic_write(run_dir / "output" / "shard-000000.parquet"),
                 unfinished_jsonl(work / "seg-0" / "shard-000001.kept.jsonl"),
                 unfinished_jsonl(run_dir / "rejects" / "shard-000002.jsonl"),
                 unfinished_directory(work / "seg-1" / "step" / "model"),
                 unfinished_directory(run_dir / "report")]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("a user's")
    foreign = [run_dir / "notes.tmp", run_dir / ".notes.tmp", run_dir / "notes.abcd1234.tmp",
               run_dir / ".notes.ABCD1234.tmp", run_dir / ".notes.abcd123.tmp", run_dir / ".notes.abcd1234.tmp.bak",
               work / "seg-0" / "mine.tmp", work / "seg-0" / ".keep.tmp" / "x", work / "seg-extra" / "x",
               run_dir / "drafts" / ".draft.abcd1234.tmp", tmp_path / ".run.abcd1234.tmp"]
    for path in foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("a user's")
    link = work / "seg-0" / ".data.abcd1234.tmp"
    link.symlink_to(elsewhere, target_is_directory=True)
    assert all(p.exists() for p in leftovers) and (work / "seg-2" / "FINGERPRINT").exists()
    stats = run_curate(config(tmp_path, crawl))
    assert [p for p in leftovers if p.exists()] == []
    assert all(p.exists() for p in foreign) and link.is_symlink() and (elsewhere / "keep.txt").exists()
    assert not (work / "seg-2").exists() and (work / "seg-1" / "FINGERPRINT").exists()
    assert stats["kept"] == 6 and outputs(run_dir) == outputs(tmp_path / "reference")


@pytest.mark.parametrize("name, content", [("empty.warc.gz", b""), ("empty.warc", b""), ("blank.jsonl", b"\n\n"),
                                           ("info.warc", None)])
def test_input_without_documents_is_an_error_as_for_prepare(tmp_path, name, content):
    path = tmp_path / name
    if content is None:  # a WARC of a warcinfo record only: no record of a kept type
        write_warc(path, [], gzip=False)
    else:
        path.write_bytes(content)
    cfg = CurateConfig(run_dir=str(tmp_path / "run"), inputs=InputsConfig(paths=[str(path)]), steps=[], workers=1)
    with pytest.raises(InputError, match=rf"no documents in {path}"):
        run_curate(cfg)
    assert not (tmp_path / "run" / "stats.json").exists()


def test_a_second_curate_into_a_busy_run_dir_is_refused_and_removes_nothing(tmp_path, crawl, monkeypatch):
    from lmforge.core.run import RunDirBusy
    from lmforge.curate import pipeline
    from tests.core.test_run import hold_in_subprocess

    run_curate(config(tmp_path, crawl))
    before = outputs(tmp_path / "run")
    holder = hold_in_subprocess(tmp_path / "run")  # e.g. a first curate still running
    try:
        monkeypatch.setattr(pipeline, "clean_leftovers", lambda *a: pytest.fail("a busy run_dir is left alone"))
        with pytest.raises(RunDirBusy, match=rf"pid {holder.pid} on "):
            run_curate(config(tmp_path, crawl, output_format="jsonl"))  # which would redo the output
    finally:
        holder.communicate("")
    assert outputs(tmp_path / "run") == before


@pytest.mark.parametrize("case", ["classifier", "classifier folder", "perplexity", "known_duplicates", "blocklist"])
def test_a_missing_file_a_step_or_the_report_reads_is_refused_before_any_work(tmp_path, crawl, capsys, monkeypatch,
                                                                               case):
    from lmforge.cli.main import main
    from lmforge.curate import pipeline

    missing = tmp_path / "missing"
    (tmp_path / "empty").mkdir()
    steps, known, key = {
        "classifier": ([{"type": "classifier", "model": str(missing), "threshold": 0.5}], None, "steps[1].model"),
        "classifier folder": ([{"type": "classifier", "model": str(tmp_path / "empty"), "threshold": 0.5}], None,
                              "steps[1].model"),
        "perplexity": ([{"type": "perplexity", "checkpoint": str(missing), "threshold": 100}], None,
                       "steps[1].checkpoint"),
        "known_duplicates": ([], str(missing), "known_duplicates"),
        "blocklist": ([{"type": "url_filter", "domains_file": str(missing)}], None, "steps[1].domains_file"),
    }[case]
    steps = json.dumps([{"type": "extract"}, *steps])
    argv = ["curate", f"inputs.paths=[{crawl}]", f"run_dir={tmp_path / 'run'}", f"steps={steps}", "workers=2",
            *([f"known_duplicates={known}"] if known else [])]
    monkeypatch.setattr(pipeline, "plan_shards", lambda *a: pytest.fail("the files are checked before any work"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lmforge curate: error: {key}: ")
    assert str(tmp_path / ("empty" if case == "classifier folder" else "missing")) in err[0]
    assert not (tmp_path / "run").exists()
