"""ChatML, the chat format lmforge's chat models read and write: its markers, the Jinja
template saved beside a tokenizer, the rendering of ``{role, content}`` turns as text, and
the checks a conversation must pass. Nothing here reads files or tokenizes: ``data.chat``
does, for fine-tuning, and ``data.documents`` reads conversations as pre-training documents.

Each turn is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; a chat model continues the
generation prompt ``<|im_start|>assistant\\n``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ROLES = ("system", "user", "assistant")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
GENERATION_PROMPT = f"{IM_START}assistant\n"

# One BOS, then ChatML turns; the assistant's content, <|im_end|> and "\n" are the generation.
CHATML_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>\\n' }}{%- endgeneration %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

Segment = tuple[str, bool]  # (text, trained)


class ExampleError(ValueError):
    """An unusable example; ``reason`` is the SkipLog key, the message says what is wrong."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def render_chatml(messages: Sequence[dict], add_generation_prompt: bool = False,
                  assistant_only: bool = True) -> list[Segment]:
    """ChatML text of ``messages`` as ``(text, trained)`` segments; joined, they are the full text.

    Each turn is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; the assistant's content,
    ``<|im_end|>`` and ``\\n`` are trained (every segment is, without ``assistant_only``).
    The BOS token is not part of the text: ``tokenize_segments`` adds it.
    """
    segments: list[Segment] = []
    for m in messages:
        if m["role"] == "assistant":
            segments.append((GENERATION_PROMPT, not assistant_only))
            segments.append((m["content"] + IM_END + "\n", True))
        else:
            segments.append((f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n", not assistant_only))
    if add_generation_prompt:
        segments.append((GENERATION_PROMPT, False))
    return segments


def chatml_text(messages: Sequence[dict]) -> str:
    """The whole ChatML text of ``messages`` (no BOS), every turn's text as ``render_chatml`` joins it."""
    return "".join(text for text, _ in render_chatml(messages, assistant_only=False))


def validate_messages(messages: Any, field: str = "messages", need_assistant: bool = True) -> None:
    """Raise ``ExampleError`` unless ``messages`` is a list of ``{role, content}`` with known roles
    and text in every turn."""
    if not isinstance(messages, list) or not messages:
        raise ExampleError("bad_messages", f"{field!r} must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ExampleError("bad_messages", f"{field}[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ExampleError("unknown_role", f"{field}[{i}] has unknown role {m['role']!r}; expected one of {ROLES}")
        if not isinstance(m["content"], str):
            raise ExampleError("content_not_string",
                               f"{field}[{i}].content is {type(m['content']).__name__}, not a string")
        if not m["content"].strip():
            raise ExampleError("empty_turn", f"{field}[{i}] ({m['role']}) is empty: a turn with no text trains "
                                             "nothing, or trains the model to answer with nothing")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ExampleError("no_assistant_turn", f"{field!r} has no assistant turn, so there is nothing to train on")


def validate_turn_order(messages: list[dict]) -> None:
    """Raise ``ExampleError`` when a conversation's first turn after the system prompt is the
    assistant's: the assistant would answer a question nobody asked (often a conversation cut
    at the front, its first user turn lost)."""
    first = next((m for m in messages if m["role"] != "system"), None)
    if first is not None and first["role"] == "assistant":
        raise ExampleError("assistant_first", "'messages' starts with an assistant turn: a conversation opens "
                                              "with the user (after an optional system turn)")
