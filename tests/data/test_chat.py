"""ChatML rendering, assistant-only labels, the HF chat template, validation and readers."""

from __future__ import annotations

import pytest

from lmforge.core.io import InputError
from lmforge.data.chat import (
    IGNORE_INDEX,
    read_sft_examples,
    tokenize_conversation,
    tokenize_example,
    tokenize_segments,
)
from lmforge.data.chatml import CHATML_TEMPLATE, render_chatml
from lmforge.data.documents import SkipLog
from lmforge.data.tokenizer import Tokenizer
from tests.conftest import write_jsonl

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [SYSTEM, {"role": "user", "content": "Name a king."}, {"role": "assistant", "content": "Lear, of course."}],
    [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\nHello!  "},
     {"role": "user", "content": "again, with ünïcödé"}, {"role": "assistant", "content": " Fine — thanks.\n"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
]


def trained_text(tok: Tokenizer, ids: list[int], labels: list[int]) -> str:
    assert all(lab in (IGNORE_INDEX, i) for i, lab in zip(ids, labels))
    return tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX])


def test_render_chatml_formats_turns_and_generation_prompt():
    msgs = CONVERSATIONS[1]
    text = "".join(s for s, _ in render_chatml(msgs, add_generation_prompt=True))
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a king.<|im_end|>\n"
                    "<|im_start|>assistant\nLear, of course.<|im_end|>\n<|im_start|>assistant\n")
    assert [s for s, t in render_chatml(msgs) if t] == ["Lear, of course.<|im_end|>\n"]


def test_labels_cover_exactly_assistant_content_end_of_turn_and_newline(small_tokenizer):
    ids, labels = tokenize_conversation(small_tokenizer, CONVERSATIONS[1], max_length=512)
    assert ids[0] == small_tokenizer.bos_id and ids[1] != small_tokenizer.bos_id  # one BOS
    assert trained_text(small_tokenizer, ids, labels) == "Lear, of course.<|im_end|>\n"
    im_end = small_tokenizer.token_to_id("<|im_end|>")
    assert labels[-2:] == [im_end, small_tokenizer.encode("\n")[0]]
    # the system/user turns and the assistant header are masked
    assert small_tokenizer.decode(ids[: labels.index(next(v for v in labels if v != IGNORE_INDEX))]).endswith(
        "<|im_start|>assistant\n")


def test_multi_turn_labels_train_every_assistant_turn(small_tokenizer):
    ids, labels = tokenize_conversation(small_tokenizer, CONVERSATIONS[2], max_length=512)
    # "\n\nHello" shares its first token with the header's "\n" (one pre-token), so it is trained too
    assert trained_text(small_tokenizer, ids, labels) == (
        "\n\n\nHello!  <|im_end|>\n Fine — thanks.\n<|im_end|>\n")


def test_pad_is_not_end_of_turn_or_eos(small_tokenizer):
    im_end = small_tokenizer.token_to_id("<|im_end|>")
    assert small_tokenizer.pad_id not in (im_end, small_tokenizer.eos_id, small_tokenizer.bos_id)
    ids, labels = tokenize_conversation(small_tokenizer, CONVERSATIONS[0], max_length=512)
    assert small_tokenizer.pad_id not in ids and im_end in labels


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_hf_apply_chat_template_gives_our_ids_and_mask(chat_tokenizer_dir, small_tokenizer, conversation,
                                                        generation_prompt):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(chat_tokenizer_dir)
    assert hf.chat_template == CHATML_TEMPLATE
    msgs = CONVERSATIONS[conversation]
    if generation_prompt:
        msgs = msgs[:-1]
    out = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=generation_prompt,
                                 return_dict=True, return_assistant_tokens_mask=True)

    ids, labels = tokenize_segments(small_tokenizer, render_chatml(msgs, add_generation_prompt=generation_prompt))
    assert list(out["input_ids"]) == ids
    assert list(out["assistant_masks"]) == [int(lab != IGNORE_INDEX) for lab in labels]


def test_prompt_completion_strings_train_completion_and_eos(small_tokenizer):
    ex = tokenize_example(small_tokenizer, {"prompt": "The king said:", "completion": " Off with his head."}, 512)
    assert ex.input_ids[0] == small_tokenizer.bos_id and ex.input_ids[-1] == small_tokenizer.eos_id
    assert trained_text(small_tokenizer, ex.input_ids, ex.labels) == " Off with his head.<|end_of_text|>"


def test_prompt_completion_conversational_trains_completion_only(small_tokenizer):
    record = {"prompt": [SYSTEM, {"role": "user", "content": "Hi"}],
              "completion": [{"role": "assistant", "content": "Hello."}]}
    ex = tokenize_example(small_tokenizer, record, 512)
    assert trained_text(small_tokenizer, ex.input_ids, ex.labels) == "Hello.<|im_end|>\n"
    full, _ = tokenize_conversation(small_tokenizer, record["prompt"] + record["completion"], 512)
    assert ex.input_ids == full


BAD = [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn", "no_assistant_turn"),
    ({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "unknown role",
     "unknown_role"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}, "not a string",
     "content_not_string"),
    ({"prompt": "a", "completion": ["b"]}, "both be strings", "bad_prompt_completion"),
    ({"text": "plain"}, "expected 'messages'", "unknown_format"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
     r"messages\[1\] \(assistant\) is empty", "empty_turn"),
    ({"messages": [{"role": "user", "content": " \n"}, {"role": "assistant", "content": "x"}]},
     r"messages\[0\] \(user\) is empty", "empty_turn"),
    ({"prompt": [{"role": "user", "content": ""}], "completion": [{"role": "assistant", "content": "x"}]},
     r"prompt\[0\] \(user\) is empty", "empty_turn"),
    ({"prompt": "Say something.", "completion": ""}, r"'completion' is empty", "empty_turn"),
    ({"prompt": "Say something.", "completion": " \n"}, r"'completion' is empty", "empty_turn"),
    ({"messages": [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "x"}]}, "starts with an assistant turn", "assistant_first"),
    ({"messages": [SYSTEM, {"role": "assistant", "content": "Hello!"}]}, "starts with an assistant turn",
     "assistant_first"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}], "x": float("nan")},
     "not a finite number", "non_finite_number"),
]


@pytest.mark.parametrize("record,message,reason", BAD)
def test_bad_example_error_names_file_and_line(tmp_path, small_tokenizer, record, message, reason):
    good = {"messages": CONVERSATIONS[0]}
    path = write_jsonl(tmp_path / "sft.jsonl", [good, good, record])
    with pytest.raises(InputError, match=rf"sft\.jsonl:3: .*{message}"):
        list(read_sft_examples([str(path)], small_tokenizer, max_length=512))
    skipped = SkipLog()
    kept = list(read_sft_examples([str(path)], small_tokenizer, max_length=512, on_bad="skip", skipped=skipped))
    assert len(kept) == 2 and skipped.by_reason == {reason: 1}
    assert skipped.examples[0].startswith(f"{path}:3: ")


def test_malformed_json_line_is_named(tmp_path, small_tokenizer):
    path = tmp_path / "sft.jsonl"
    path.write_text('{"messages": []}\n{oops\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"sft\.jsonl:1: .*non-empty list"):
        list(read_sft_examples([str(path)], small_tokenizer, max_length=512))
    skipped = SkipLog()
    assert list(read_sft_examples([str(path)], small_tokenizer, 512, on_bad="skip", skipped=skipped)) == []
    assert skipped.by_reason == {"bad_messages": 1, "malformed_json": 1}


def test_too_long_examples_error_skip_or_truncate_and_are_counted(tmp_path, small_tokenizer):
    long_answer = {"messages": [{"role": "user", "content": "Tell me."},
                                {"role": "assistant", "content": "word " * 200}]}
    long_prompt = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": CONVERSATIONS[0]}, long_answer, long_prompt])
    with pytest.raises(InputError, match=r"sft\.jsonl:2: .*more than max_length=64"):
        list(read_sft_examples([str(path)], small_tokenizer, max_length=64))

    skipped = SkipLog()
    kept = list(read_sft_examples([str(path)], small_tokenizer, 64, on_too_long="skip", skipped=skipped))
    assert [e.source for e in kept] == [f"{path}:1"] and skipped.by_reason == {"too_long": 2}

    skipped = SkipLog()
    kept = list(read_sft_examples([str(path)], small_tokenizer, 64, on_too_long="truncate", skipped=skipped))
    assert [e.source for e in kept] == [f"{path}:1", f"{path}:2"]
    assert len(kept[1].input_ids) == len(kept[1].labels) == 64
    # truncation of the prompt leaves nothing to train: skipped, not silently kept
    assert skipped.by_reason == {"truncated": 1, "no_targets_after_truncation": 1}


def test_parquet_rows_are_read_with_row_numbers(tmp_path, small_tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": "Say hi.", "completion": " hi"}, {"prompt": "Say bye.", "completion": " bye"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    kept = list(read_sft_examples([str(tmp_path / "a.parquet")], small_tokenizer, 64))
    assert [e.source for e in kept] == [f"{tmp_path / 'a.parquet'}:row 1", f"{tmp_path / 'a.parquet'}:row 2"]
    assert trained_text(small_tokenizer, kept[0].input_ids, kept[0].labels) == " hi<|end_of_text|>"


def test_a_parquet_file_damaged_partway_is_a_bad_example_naming_the_row(tmp_path, small_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"Q{i}", "completion": " A."} for i in range(6)]), path,
                   row_group_size=2)
    offset = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    data[offset:offset + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"sft\.parquet:row 3: damaged Parquet data"):
        list(read_sft_examples([str(path)], small_tokenizer, max_length=64))
    skipped = SkipLog()
    assert len(list(read_sft_examples([str(path)], small_tokenizer, 64, on_bad="skip", skipped=skipped))) == 2
    assert skipped.by_reason == {"damaged_file": 1}
