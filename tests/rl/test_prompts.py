"""Prompt files: TRL's `prompt` and `messages` records, the reference answer, the fields a reward
needs, and errors naming the file and line before any rollout."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.core.io import InputError
from lmforge.data.chat import chat_prompt_ids
from lmforge.data.documents import SkipLog
from lmforge.data.sft_demo import make_examples
from lmforge.rl.prompts import read_prompts
from tests.conftest import write_jsonl


def test_messages_drop_the_final_assistant_turn_which_becomes_the_answer(tmp_path, small_tokenizer):
    examples = make_examples(3, seed=1)
    (p, *_) = read_prompts([str(write_jsonl(tmp_path / "p.jsonl", examples))], small_tokenizer)
    assert p.prompt == examples[0]["messages"][:2] and p.reference == examples[0]["messages"][2]["content"]
    assert p.ids == chat_prompt_ids(small_tokenizer, examples[0]["messages"][:2])
    assert p.fields == {"task": "arithmetic", "answer": examples[0]["answer"]} and p.source.endswith("p.jsonl:1")
    assert p.conversational


def test_a_records_own_answer_wins_over_the_reference_turn(tmp_path, small_tokenizer):
    record = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "four"}], "answer": "4"}
    (p,) = read_prompts([str(write_jsonl(tmp_path / "p.jsonl", [record]))], small_tokenizer)
    assert p.fields["answer"] == "4" and p.reference == "four"


def test_plain_and_conversational_prompt_fields_from_parquet(tmp_path, small_tokenizer):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "Once upon", "answer": "a time"}]), path)
    (p,) = read_prompts([str(path)], small_tokenizer)
    assert p.ids == [small_tokenizer.bos_id, *small_tokenizer.encode("Once upon")] and not p.conversational
    assert p.source.endswith("p.parquet:row 1") and p.fields == {"answer": "a time"}
    chat = write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "Hi"}], "id": 7}])
    (c,) = read_prompts([str(chat)], small_tokenizer)
    assert c.ids == chat_prompt_ids(small_tokenizer, [{"role": "user", "content": "Hi"}]) and c.fields == {"id": 7}


def test_a_record_without_a_field_the_reward_needs_names_file_and_line(tmp_path, small_tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(InputError, match=r"p\.jsonl:2: the reward needs field\(s\) \['answer'\]"):
        read_prompts([str(path)], small_tokenizer, required_fields=["answer"])
    skipped = SkipLog()
    kept = read_prompts([str(path)], small_tokenizer, required_fields=["answer"], on_bad="skip", skipped=skipped)
    assert [p.prompt for p in kept] == ["a"] and dict(skipped.by_reason) == {"missing_field": 1}


@pytest.mark.parametrize("record, message", [
    ({"text": "no prompt"}, "exactly one of 'prompt'"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "exactly one of 'prompt'"),
    ({"prompt": "  "}, "'prompt' is empty"),
    ({"messages": "hello"}, "got a string"),
    ({"messages": [{"role": "assistant", "content": "only an answer"}]}, "must end with a user turn"),
    ({"messages": [{"role": "user", "content": ""}]}, "is empty"),
])
def test_bad_prompt_records_name_file_and_line(tmp_path, small_tokenizer, record, message):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, record])
    with pytest.raises(InputError, match=rf"p\.jsonl:2: .*{message}"):
        read_prompts([str(path)], small_tokenizer)


def test_a_prompt_leaving_no_room_for_the_response_is_refused(tmp_path, small_tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "word " * 50}])
    with pytest.raises(InputError, match=r"p\.jsonl:1: the prompt takes \d+ tokens, more than the 10"):
        read_prompts([str(path)], small_tokenizer, max_tokens=10)


def test_a_file_of_only_bad_prompts_says_so(tmp_path, small_tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "x"}])
    with pytest.raises(InputError, match="no usable prompts"):
        read_prompts([str(path)], small_tokenizer, on_bad="skip")
