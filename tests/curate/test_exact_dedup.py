from lmforge.curate.exact_dedup import ExactDedup, ExactDedupConfig
from lmforge.data.documents import Document


def run_corpus_step(step, shards, work_dir):
    for k, docs in enumerate(shards):
        step.index_shard(k, docs, work_dir)
    step.resolve(work_dir, len(shards), lambda fn, items: [fn(x) for x in items])
    return [step.apply_shard(k, docs, work_dir) for k, docs in enumerate(shards)]


def docs(*texts, prefix="d"):
    return [Document(f"{prefix}{i}", t) for i, t in enumerate(texts)]


def test_first_document_in_shard_order_wins(tmp_path):
    shards = [docs("alpha", "beta", "alpha", prefix="a"), docs("beta ", "gamma", prefix="b")]
    decisions = run_corpus_step(ExactDedup(ExactDedupConfig(num_buckets=3)), shards, tmp_path)
    assert decisions == [[None, None, "exact-duplicate of a0"], ["exact-duplicate of a1", None]]


def test_lowercase_option_folds_case(tmp_path):
    shards = [docs("Alpha", "alpha")]
    assert run_corpus_step(ExactDedup(ExactDedupConfig()), shards, tmp_path / "a") == [[None, None]]
    assert run_corpus_step(ExactDedup(ExactDedupConfig(lowercase=True)), shards, tmp_path / "b") == \
        [[None, "exact-duplicate of d0"]]


def test_line_dedup_removes_lines_seen_earlier_and_rejects_emptied_documents(tmp_path):
    shards = [docs("menu\nfirst story\nfooter", "menu\nfooter"), docs("menu\nsecond story\n\nfooter")]
    decisions = run_corpus_step(ExactDedup(ExactDedupConfig(unit="line", num_buckets=2)), shards, tmp_path)
    assert decisions[0][0] is None and shards[0][0].text == "menu\nfirst story\nfooter"
    assert decisions[0][1].startswith("all-lines-duplicate")
    assert decisions[1] == [None] and shards[1][0].text == "second story"
    assert shards[1][0].metadata["removed_lines"] == 2


def test_paragraph_dedup_keeps_the_first_copy(tmp_path):
    shards = [docs("intro\n\nshared para\n\nend one", "shared para\n\nend two")]
    decisions = run_corpus_step(ExactDedup(ExactDedupConfig(unit="paragraph")), shards, tmp_path)
    assert decisions == [[None, None]]
    assert shards[0][0].text == "intro\n\nshared para\n\nend one" and shards[0][1].text == "end two"


def test_resolve_fans_out_one_task_per_bucket(tmp_path):
    calls = []

    def pool_map(fn, items):
        calls.append(list(items))
        return [fn(x) for x in items]

    step = ExactDedup(ExactDedupConfig(num_buckets=5))
    step.index_shard(0, docs("a", "b"), tmp_path)
    step.resolve(tmp_path, 1, pool_map)
    assert calls == [[0, 1, 2, 3, 4]]
