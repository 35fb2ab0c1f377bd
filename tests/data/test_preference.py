"""Preference data: TRL's formats, completion-only labels, bad pairs, padding and KTO's KL rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.core.io import InputError
from lmforge.data.chat import IGNORE_INDEX
from lmforge.data.documents import SkipLog
from lmforge.data.preference import (
    pair_rows,
    parse_pair,
    parse_unpaired,
    read_preference_pairs,
    read_unpaired_examples,
    unpaired_rows,
)
from lmforge.data.preference_demo import make_pairs, rule_mistake, unpair
from lmforge.data.sft_demo import TASKS, exact_match, make_examples
from tests.conftest import write_jsonl

USER = {"role": "user", "content": "What is 2 + 3?"}


def completion_text(tok, c) -> str:
    return tok.decode([t for t, label in zip(c.input_ids, c.labels) if label != IGNORE_INDEX])


def test_plain_pair_trains_the_completion_and_eos_only(small_tokenizer):
    tok = small_tokenizer
    pair, truncated = parse_pair(tok, {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}, 64, "error")
    assert not truncated
    assert pair.chosen.input_ids[0] == tok.bos_id and pair.chosen.input_ids[-1] == tok.eos_id
    assert pair.chosen.labels[-1] == tok.eos_id  # EOS is a target, never masked as padding
    assert completion_text(tok, pair.chosen) == " blue.<|end_of_text|>"
    assert pair.chosen.input_ids[: pair.chosen.prompt_len] == pair.rejected.input_ids[: pair.rejected.prompt_len]


def test_conversational_pair_and_implicit_prompt_give_the_same_tokens(small_tokenizer):
    tok = small_tokenizer
    explicit = {"prompt": [USER], "chosen": [{"role": "assistant", "content": "5"}],
                "rejected": [{"role": "assistant", "content": "6"}]}
    implicit = {"chosen": [USER, {"role": "assistant", "content": "5"}],
                "rejected": [USER, {"role": "assistant", "content": "6"}]}
    a, _ = parse_pair(tok, explicit, 64, "error")
    b, _ = parse_pair(tok, implicit, 64, "error")
    assert a.chosen == b.chosen and a.rejected == b.rejected
    assert completion_text(tok, a.chosen) == "5<|im_end|>\n"


@pytest.mark.parametrize(("record", "reason"), [
    ({"prompt": "Q", "chosen": " same", "rejected": " same"}, "identical"),
    ({"prompt": "Q", "chosen": "", "rejected": " no"}, "'chosen' is empty"),
    ({"prompt": [USER], "chosen": [{"role": "assistant", "content": " "}],
      "rejected": [{"role": "assistant", "content": "6"}]}, "'chosen' is empty"),
    ({"prompt": "word " * 80, "chosen": " a", "rejected": " b"}, "leaving no room"),
    ({"prompt": "Q", "chosen": " a"}, "missing ['rejected']"),
    ({"prompt": "Q", "chosen": " a", "rejected": " b", "margin": "big"}, "'margin' must be a number"),
    ({"prompt": "Q", "chosen": " a", "rejected": " b", "margin": float("nan")}, "NaN is not a finite number"),
    ({"prompt": "Q", "chosen": " a", "rejected": " b", "margin": float("inf")}, "Infinity is not a finite number"),
    ({"prompt": "Q", "chosen": " a", "rejected": " b", "margin": 10**400}, "must be a finite number"),
    ({"chosen": [[None], {"role": "assistant", "content": "a"}], "rejected": [[None], {"role": "assistant",
      "content": "b"}]}, "prompt[0] must be an object with 'role' and 'content'"),
])
def test_bad_pairs_are_errors_naming_file_and_line_or_are_skipped_and_counted(small_tokenizer, tmp_path, record,
                                                                               reason):
    good = {"prompt": "Q", "chosen": " yes", "rejected": " no"}
    path = write_jsonl(tmp_path / "pairs.jsonl", [good, record, good])
    with pytest.raises(InputError, match=rf"pairs.jsonl:2: .*{__import__('re').escape(reason)}"):
        read_preference_pairs([str(path)], small_tokenizer, 48)
    skipped = SkipLog()
    pairs = read_preference_pairs([str(path)], small_tokenizer, 48, on_bad="skip", skipped=skipped)
    assert len(pairs) == 2 and skipped.total == 1


def test_malformed_json_is_an_error_naming_the_line(small_tokenizer, tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "Q", "chosen": " a", "rejected": " b"}\n{"prompt": \n')
    with pytest.raises(InputError, match="pairs.jsonl:2"):
        read_preference_pairs([str(path)], small_tokenizer, 48)


def test_long_completions_are_truncated_skipped_or_refused(small_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Q", "chosen": " a" * 100, "rejected": " b"}])
    skipped = SkipLog()
    (pair,) = read_preference_pairs([str(path)], small_tokenizer, 32, skipped=skipped)
    assert len(pair.chosen.input_ids) == 32 and skipped.by_reason["truncated"] == 1
    assert read_preference_pairs([str(path)], small_tokenizer, 32, on_too_long="skip") == []
    with pytest.raises(InputError, match="p.jsonl:1: .*more than max_length=32"):
        read_preference_pairs([str(path)], small_tokenizer, 32, on_too_long="error")


def test_unpaired_labels_must_be_booleans(small_tokenizer, tmp_path):
    rows = [{"prompt": "Q", "completion": " a", "label": True}, {"prompt": "Q", "completion": " b", "label": "yes"},
            {"prompt": "Q", "completion": " c", "label": 1}]
    path = write_jsonl(tmp_path / "kto.jsonl", rows)
    with pytest.raises(InputError, match="kto.jsonl:2: 'label' must be true or false, got 'yes'"):
        read_unpaired_examples([str(path)], small_tokenizer, 32)
    skipped = SkipLog()
    kept = read_unpaired_examples([str(path)], small_tokenizer, 32, on_bad="skip", skipped=skipped)
    assert len(kept) == 1 and skipped.by_reason["bad_label"] == 2


def test_parquet_pairs_read_like_jsonl(small_tokenizer, tmp_path):
    records = [{"prompt": "Q", "chosen": " yes", "rejected": " no"}, {"prompt": "R", "chosen": " up", "rejected": " down"}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    jsonl = write_jsonl(tmp_path / "p.jsonl", records)
    a = read_preference_pairs([str(tmp_path / "p.parquet")], small_tokenizer, 32)
    b = read_preference_pairs([str(jsonl)], small_tokenizer, 32)
    assert [(p.chosen, p.rejected) for p in a] == [(p.chosen, p.rejected) for p in b]


@pytest.mark.parametrize("margin", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_margin_in_parquet_is_a_bad_pair(small_tokenizer, tmp_path, margin):
    records = [{"prompt": "Q", "chosen": " yes", "rejected": " no", "margin": 1.0},
               {"prompt": "R", "chosen": " up", "rejected": " down", "margin": margin}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    with pytest.raises(InputError, match=r"p\.parquet:row 2: 'margin' must be a finite number"):
        read_preference_pairs([str(tmp_path / "p.parquet")], small_tokenizer, 32)
    skipped = SkipLog()
    assert len(read_preference_pairs([str(tmp_path / "p.parquet")], small_tokenizer, 32, on_bad="skip",
                                     skipped=skipped)) == 1
    assert skipped.by_reason == {"bad_margin": 1}


def test_left_and_right_padding_hold_the_same_tokens(small_tokenizer):
    tok = small_tokenizer
    pairs = [parse_pair(tok, {"prompt": "Q" * n, "chosen": " a" * n, "rejected": " b"}, 64, "error")[0]
             for n in (1, 3, 5)]
    right, left = pair_rows(pairs, tok.eos_id), pair_rows(pairs, tok.eos_id, side="left")
    for i in range(3):
        r, lm = right["chosen_attention_mask"][i].bool(), left["chosen_attention_mask"][i].bool()
        assert right["chosen_input_ids"][i][r].tolist() == left["chosen_input_ids"][i][lm].tolist()
        assert right["chosen_labels"][i][r].tolist() == left["chosen_labels"][i][lm].tolist()
        assert (right["chosen_labels"][i][~r] == IGNORE_INDEX).all()


def test_kto_kl_rows_pair_each_prompt_with_another_examples_completion(small_tokenizer):
    tok = small_tokenizer
    records = [{"prompt": f"P{i}", "completion": f" c{i}", "label": i % 2 == 0} for i in range(5)]
    examples = [parse_unpaired(tok, r, 32, "error")[0] for r in records]
    rows = unpaired_rows(examples, tok.pad_id, 32, seed=0)
    assert rows["desirable"].tolist() == [True, False, True, False, True]
    partners = []
    for i in range(5):
        mask = rows["kl_attention_mask"][i].bool()
        text = tok.decode(rows["kl_input_ids"][i][mask].tolist())
        assert text.startswith(f"<|begin_of_text|>P{i} c")
        partners.append(int(text.split(" c")[1][0]))
    assert all(p != i for i, p in enumerate(partners)) and sorted(partners) == list(range(5))  # a permutation
    with pytest.raises(InputError, match="at least 2 examples"):
        unpaired_rows(examples[:1], tok.pad_id, 32)


@pytest.mark.parametrize("task", list(TASKS))
def test_rule_mistakes_are_wrong_answers(task):
    import random

    rng = random.Random(0)
    for ex in make_examples(40, seed=1, tasks=[task]):
        wrong = rule_mistake(task, ex["messages"][1]["content"], ex["answer"], rng)
        assert not exact_match(wrong, ex["answer"])


def test_demo_pairs_prefer_the_correct_answer_and_use_the_models_wrong_answers():
    examples = make_examples(10, seed=2)
    answers = [ex["answer"] if i % 2 else "0 0 0" for i, ex in enumerate(examples)]  # odd ones: the model was right
    pairs = make_pairs(examples, answers)
    for i, (p, ex) in enumerate(zip(pairs, examples)):
        assert p["chosen"][0]["content"] == ex["answer"]
        assert not exact_match(p["rejected"][0]["content"], ex["answer"])
        assert p["rejected_source"] == ("rule" if i % 2 else "model")
    kto = unpair(pairs)
    assert [k["label"] for k in kto[:4]] == [True, False, True, False]


def test_chosen_and_rejected_share_one_tokenization_of_a_prompt_ending_in_a_space(small_tokenizer):
    tok = small_tokenizer
    record = {"prompt": "The answer is ", "chosen": "the king", "rejected": "42"}
    pair, _ = parse_pair(tok, record, 64, "error")
    prompt_ids = [tok.bos_id, *tok.hf.encode("The answer is ", add_special_tokens=False).ids]
    for side, text in ((pair.chosen, "the king"), (pair.rejected, "42")):
        assert side.prompt_len == len(prompt_ids) and side.input_ids[: side.prompt_len] == prompt_ids
        completion = [*tok.hf.encode(text, add_special_tokens=False).ids, tok.eos_id]
        assert side.input_ids[side.prompt_len:] == completion  # the completion tokenized on its own
        assert side.labels == [IGNORE_INDEX] * side.prompt_len + completion  # labels start right after the prompt


def test_conversational_completions_tokenized_apart_equal_the_whole_rendered_text(small_tokenizer):
    from lmforge.data.chat import tokenize_segments
    from lmforge.data.chatml import render_chatml

    tok = small_tokenizer
    prompt, chosen = [USER], [{"role": "assistant", "content": " 5 "}]
    pair, _ = parse_pair(tok, {"prompt": prompt, "chosen": chosen,
                               "rejected": [{"role": "assistant", "content": "6"}]}, 64, "error")
    ids, labels = tokenize_segments(tok, [*render_chatml(prompt), *render_chatml(chosen)])
    assert (pair.chosen.input_ids, pair.chosen.labels) == (ids, labels)  # special tokens cut the text anyway
    assert pair.chosen.input_ids[: pair.chosen.prompt_len] == pair.rejected.input_ids[: pair.rejected.prompt_len]
    assert tok.decode(pair.chosen.input_ids[: pair.chosen.prompt_len]).endswith("<|im_start|>assistant\n")


def test_kto_mismatched_rows_keep_the_prompt_tokens_and_append_the_other_completion(small_tokenizer):
    tok = small_tokenizer
    records = [{"prompt": f"Item {i} is ", "completion": ["the king", "42", "a cat"][i], "label": i != 1}
               for i in range(3)]
    examples = [parse_unpaired(tok, r, 64, "error")[0] for r in records]
    rows = unpaired_rows(examples, tok.pad_id, 64, seed=0)
    completions = [e.completion for e in examples]
    for i, c in enumerate(completions):
        assert c.input_ids[: c.prompt_len] == [tok.bos_id, *tok.hf.encode(records[i]["prompt"],
                                                                          add_special_tokens=False).ids]
        mask = rows["kl_attention_mask"][i].bool()
        kl_ids, kl_labels = rows["kl_input_ids"][i][mask].tolist(), rows["kl_labels"][i][mask].tolist()
        assert kl_ids[: c.prompt_len] == c.input_ids[: c.prompt_len]
        tail = kl_ids[c.prompt_len:]
        assert tail in [o.input_ids[o.prompt_len:] for j, o in enumerate(completions) if j != i]
        assert kl_labels == [IGNORE_INDEX] * c.prompt_len + tail


def test_an_empty_data_file_is_an_error_saying_it_is_empty(small_tokenizer, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "Q", "chosen": " yes", "rejected": " no"}])
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InputError, match=r"empty.jsonl: the file is empty"):
        read_preference_pairs([str(good), str(tmp_path / "empty.jsonl")], small_tokenizer, 32)
    with pytest.raises(InputError, match=r"empty.jsonl: the file is empty"):
        read_unpaired_examples([str(tmp_path / "empty.jsonl")], small_tokenizer, 32)
