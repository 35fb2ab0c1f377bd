"""Chat data for supervised fine-tuning: tokenization of ChatML (``data.chatml``), loss masks, readers.

An SFT example is either a conversation ``{"messages": [{"role", "content"}, ...]}`` or a
prompt-completion pair ``{"prompt", "completion"}`` whose two fields are both plain
strings or both conversational lists (TRL's dataset formats). Every example becomes
``(input_ids, labels)`` with one BOS at the start and ``labels == -100`` wherever no loss
is taken: with ``assistant_only`` a conversation trains the assistant's content, its
``<|im_end|>`` and the ``\\n`` after it (as TRL's training templates do); a prompt-completion
pair trains the completion only, plus EOS when the completion is a plain string.

A turn or a completion without text, and a conversation whose first turn after the system prompt is the
assistant's, are bad examples (``on_bad``): neither teaches the model to answer the user.

Token ids are those of the whole rendered text (special tokens split it, so ids do not
depend on how it was cut), and a token is trained when its characters overlap a trained
span. ``CHATML_TEMPLATE`` reproduces the same ids and, through its ``{% generation %}``
markers, the same assistant mask in ``transformers``' ``apply_chat_template``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lmforge.core.io import InputError, atomic_write_json, expand_paths, read_json
from lmforge.data.chatml import (
    CHATML_TEMPLATE,
    ExampleError,
    Segment,
    render_chatml,
    validate_messages,
    validate_turn_order,
)
from lmforge.data.documents import (
    PARQUET_SUFFIXES,
    BadRecord,
    DamagedFile,
    SkipLog,
    jsonl_records,
    open_parquet,
    parquet_batches,
    parquet_rows,
)
from lmforge.data.packing import IGNORE_INDEX
from lmforge.data.tokenizer import TOKENIZER_CONFIG_FILE, Tokenizer

OnBad = Literal["error", "skip"]
OnTooLong = Literal["error", "truncate", "skip"]


@dataclass
class SFTExample:
    input_ids: list[int]
    labels: list[int]
    source: str  # file:line (or "<memory>")


# -- rendering


def chat_prompt_ids(tok: Tokenizer, messages: Sequence[dict]) -> list[int]:
    """``[BOS]`` + the ChatML text of ``messages`` up to the assistant's generation prompt: what a
    chat model continues (as HF's ``apply_chat_template(..., add_generation_prompt=True)`` renders)."""
    text = "".join(seg for seg, _ in render_chatml(messages, add_generation_prompt=True))
    return [tok.bos_id, *tok.encode(text)]


def tokenize_segments(tok: Tokenizer, segments: Sequence[Segment], add_eos: bool = False,
                      add_bos: bool = True) -> tuple[list[int], list[int]]:
    """``[BOS] + encode(text) (+ [EOS])`` and labels: a token is trained if it overlaps a trained span.

    ``add_bos=False`` tokenizes a piece to be appended to another (a preference completion).
    """
    text = "".join(s for s, _ in segments)
    trained = bytearray(len(text))
    pos = 0
    for s, t in segments:
        if t:
            trained[pos : pos + len(s)] = b"\x01" * len(s)
        pos += len(s)
    enc = tok.hf.encode(text, add_special_tokens=False)
    ids = [tok.bos_id, *enc.ids] if add_bos else list(enc.ids)
    labels = [IGNORE_INDEX] if add_bos else []
    for idx, (start, end) in zip(enc.ids, enc.offsets):
        labels.append(idx if any(trained[start:end]) else IGNORE_INDEX)
    if add_eos:
        ids.append(tok.eos_id)
        labels.append(tok.eos_id)
    return ids, labels


# -- validation


def example_segments(record: dict, assistant_only: bool = True) -> tuple[list[Segment], bool]:
    """Validate one record and return its segments and whether EOS is appended."""
    if "messages" in record:
        validate_messages(record["messages"])
        validate_turn_order(record["messages"])
        return render_chatml(record["messages"], assistant_only=assistant_only), False
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion.strip():  # as an empty assistant turn of a conversation is
                raise ExampleError("empty_turn", "'completion' is empty: it trains the model to answer with nothing")
            return [(prompt, False), (completion, True)], True
        if isinstance(prompt, list) and isinstance(completion, list):
            validate_messages(prompt, "prompt", need_assistant=False)
            validate_messages(completion, "completion")
            if any(m["role"] != "assistant" for m in completion):
                raise ExampleError("bad_messages", "'completion' may hold only assistant turns")
            # the completion's untrained header "<|im_start|>assistant\n" is the prompt's generation prompt
            return [*render_chatml(prompt, assistant_only=True), *render_chatml(completion)], False
        raise ExampleError("bad_prompt_completion",
                           "'prompt' and 'completion' must both be strings or both be lists of messages, got "
                           f"{type(prompt).__name__} and {type(completion).__name__}")
    raise ExampleError("unknown_format", f"expected 'messages' or 'prompt' and 'completion', got keys {sorted(record)[:8]}")


# -- tokenizing with policies


def tokenize_conversation(tok: Tokenizer, messages: Sequence[dict], max_length: int,
                          assistant_only: bool = True) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of a conversation; raises ``ExampleError`` if invalid or longer than ``max_length``."""
    validate_messages(list(messages), need_assistant=assistant_only)
    ids, labels = tokenize_segments(tok, render_chatml(messages, assistant_only=assistant_only))
    if len(ids) > max_length:
        raise ExampleError("too_long", f"{len(ids)} tokens, more than max_length={max_length}")
    return ids, labels


def tokenize_example(tok: Tokenizer, record: dict, max_length: int, *, where: str = "<memory>",
                     on_bad: OnBad = "error", on_too_long: OnTooLong = "error",
                     skipped: SkipLog | None = None, assistant_only: bool = True) -> SFTExample | None:
    """Tokenize one record under the policies; ``None`` when it was skipped (and counted in ``skipped``).

    A bad example or one over ``max_length`` is an ``InputError`` naming ``where`` unless the
    policy skips it; ``truncate`` keeps the first ``max_length`` tokens (TRL's ``keep_start``).
    """
    skipped = skipped if skipped is not None else SkipLog()
    try:
        if not isinstance(record, dict):
            raise ExampleError("not_an_object", f"expected a JSON object, got {type(record).__name__}")
        segments, add_eos = example_segments(record, assistant_only)
    except ExampleError as exc:
        if on_bad == "error":
            raise InputError(f"{where}: {exc} (set on_bad: skip to skip and count such examples)") from exc
        skipped.add(exc.reason, where, str(exc))
        return None
    ids, labels = tokenize_segments(tok, segments, add_eos)
    if len(ids) > max_length:
        detail = f"{len(ids)} tokens, more than max_length={max_length}"
        if on_too_long == "error":
            raise InputError(f"{where}: {detail} (raise max_length, or set on_too_long: truncate or skip)")
        if on_too_long == "skip":
            skipped.add("too_long", where, detail)
            return None
        ids, labels = ids[:max_length], labels[:max_length]
        if all(v == IGNORE_INDEX for v in labels[1:]):
            skipped.add("no_targets_after_truncation", where, detail)
            return None
        skipped.add("truncated", where, detail)
    return SFTExample(ids, labels, where)


# -- reading files


def read_sft_records(paths: list[str]) -> Iterator[tuple[str, Any]]:
    """Yield ``(file:line, record)`` for every row of JSONL/Parquet files; malformed JSON yields an
    ``ExampleError``; a file with no records is an ``InputError``."""
    for path in expand_paths(paths, what="SFT data"):
        empty = True
        for item in _read_parquet(path) if path.name.lower().endswith(PARQUET_SUFFIXES) else _read_jsonl(path):
            empty = False
            yield item
        if empty:
            raise InputError(f"{path}: the file is empty (no records); remove it from the recipe or fill it")


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    for where, record in jsonl_records(path):
        yield where, ExampleError(record.reason, record.detail) if isinstance(record, BadRecord) else record


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    row = 0
    try:
        for batch in parquet_batches(open_parquet(path), path, batch_size=1024):
            for record, problem in parquet_rows(batch):
                row += 1
                if problem:
                    yield f"{path}:row {row}", ExampleError("invalid_utf8", problem)
                    continue
                yield f"{path}:row {row}", {k: v for k, v in record.items() if v is not None}
    except DamagedFile as exc:
        yield f"{path}:{exc.line}", ExampleError("damaged_file", exc.detail)


def read_sft_examples(paths: list[str], tok: Tokenizer, max_length: int, *, on_bad: OnBad = "error",
                      on_too_long: OnTooLong = "error", skipped: SkipLog | None = None,
                      assistant_only: bool = True) -> Iterator[SFTExample]:
    """Tokenized SFT examples of JSONL/Parquet files with ``messages`` or ``prompt``/``completion`` rows."""
    skipped = skipped if skipped is not None else SkipLog()
    for where, record in read_sft_records(paths):
        if isinstance(record, ExampleError):
            if on_bad == "error":
                raise InputError(f"{where}: {record} (set on_bad: skip to skip and count such examples)")
            skipped.add(record.reason, where, str(record))
            continue
        example = tokenize_example(tok, record, max_length, where=where, on_bad=on_bad,
                                   on_too_long=on_too_long, skipped=skipped, assistant_only=assistant_only)
        if example is not None:
            yield example


# -- the HF template


def add_chat_template(tokenizer_dir: str | Path, template: str = CHATML_TEMPLATE) -> None:
    """Store ``template`` as ``chat_template`` in the directory's tokenizer_config.json."""
    path = Path(tokenizer_dir) / TOKENIZER_CONFIG_FILE
    config = read_json(path, "tokenizer config")
    config["chat_template"] = template
    atomic_write_json(path, config)
