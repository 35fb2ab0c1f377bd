"""Prompts for rollouts: TRL's prompt datasets from JSONL or Parquet.

A record holds its prompt as ``prompt`` (plain text, continued as written after one BOS, or
a conversation: a list of ``{role, content}``) or as ``messages`` (a conversation), plus any
fields a reward reads (``answer``, ``task``...). A conversation is rendered with ChatML up to
the assistant's generation prompt (``data.chat.chat_prompt_ids``, what ``lmforge sft``
trained on). A final assistant turn in ``messages`` is the reference answer: it is dropped
from the prompt, kept as ``reference``, and is the ``answer`` field unless the record has
its own, so the SFT demo data (``data/sft/*.jsonl``) is a prompt file as it stands.

A record without a field the configured reward needs, an empty or malformed prompt, and a
prompt too long to leave room for the response are errors naming the file and line, raised
while reading, before any rollout (or, with ``on_bad: skip``, skipped and counted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lmforge.core.io import InputError
from lmforge.data.chat import OnBad, chat_prompt_ids, read_sft_records
from lmforge.data.chatml import ExampleError, validate_messages
from lmforge.data.documents import SkipLog
from lmforge.data.tokenizer import Tokenizer

PROMPT_KEYS = ("prompt", "messages")


@dataclass
class Prompt:
    """One prompt: its token ids, where it came from, the prompt as given, the record's other fields."""

    ids: list[int]
    source: str  # file:line
    prompt: str | list[dict]  # plain text, or the conversation without its reference answer
    fields: dict[str, Any] = field(default_factory=dict)  # every other field of the record (+ `answer`, see above)
    reference: str | None = None  # the final assistant turn of `messages`, when it had one

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def parse_prompt(tok: Tokenizer, record: Any, where: str = "<memory>") -> Prompt:
    """The ``Prompt`` of one record; raises ``ExampleError`` for a record that holds no usable prompt."""
    if not isinstance(record, dict):
        raise ExampleError("not_an_object", f"expected a JSON object, got {type(record).__name__}")
    keys = [k for k in PROMPT_KEYS if k in record]
    if len(keys) != 1:
        raise ExampleError("unknown_format", "a prompt record needs exactly one of 'prompt' (text or messages) or "
                                             f"'messages', got keys {sorted(record)[:8]}")
    fields = {k: v for k, v in record.items() if k != keys[0]}
    value = record[keys[0]]
    if isinstance(value, str):
        if keys[0] == "messages":
            raise ExampleError("bad_messages", "'messages' must be a list of {role, content} objects, got a string")
        if not value.strip():
            raise ExampleError("empty_prompt", "'prompt' is empty")
        return Prompt([tok.bos_id, *tok.encode(value)], where, value, fields)
    validate_messages(value, keys[0], need_assistant=False)
    reference = None
    if value[-1]["role"] == "assistant":
        value, reference = value[:-1], value[-1]["content"]
        fields.setdefault("answer", reference)
    if not value or value[-1]["role"] == "assistant" or all(m["role"] == "system" for m in value):
        raise ExampleError("no_user_turn", f"{keys[0]!r} must end with a user turn for the model to answer "
                                           "(after dropping a final assistant turn, the reference answer)")
    return Prompt(chat_prompt_ids(tok, value), where, value, fields, reference)


def read_prompts(paths: Sequence[str], tok: Tokenizer, *, required_fields: Sequence[str] = (),
                 max_tokens: int | None = None, on_bad: OnBad = "error", skipped: SkipLog | None = None) -> list[Prompt]:
    """Every prompt of the JSONL/Parquet files in order. A record lacking a field of
    ``required_fields`` (what the rewards read), or whose prompt takes more than ``max_tokens``
    tokens, is bad: an ``InputError`` naming ``file:line``, or skipped and counted in ``skipped``."""
    skipped = skipped if skipped is not None else SkipLog()
    prompts = []
    for where, record in read_sft_records(list(paths)):
        try:
            if isinstance(record, ExampleError):
                raise record
            prompt = parse_prompt(tok, record, where)
            missing = [f for f in required_fields if f not in prompt.fields]
            if missing:
                raise ExampleError("missing_field", f"the reward needs field(s) {missing}, which this record lacks "
                                                    f"(it has {sorted(record)[:8]})")
            if max_tokens is not None and len(prompt.ids) > max_tokens:
                raise ExampleError("prompt_too_long", f"the prompt takes {len(prompt.ids)} tokens, more than the "
                                                      f"{max_tokens} that leave room for the response")
        except ExampleError as exc:
            if on_bad == "error":
                raise InputError(f"{where}: {exc} (set on_bad: skip to skip and count such records)") from exc
            skipped.add(exc.reason, where, str(exc))
            continue
        prompts.append(prompt)
    if not prompts:
        raise InputError(f"no usable prompts in {list(paths)} ({skipped.total} skipped: {dict(skipped.by_reason)})")
    return prompts
