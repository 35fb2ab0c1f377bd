"""Preference data for reward models, DPO and KTO: TRL's formats, validation, padded rows.

Two formats, each plain (strings) or conversational (lists of ``{role, content}``), from
JSONL or Parquet, as TRL defines them:

* paired: ``{"prompt", "chosen", "rejected"}``. A conversational pair may leave the prompt
  implicit: ``chosen`` and ``rejected`` are whole conversations whose shared leading turns
  are the prompt.
* unpaired (KTO): ``{"prompt", "completion", "label"}`` with a boolean ``label`` (desirable).

A completion is laid out as SFT's prompt-completion pair (``lmforge.data.chat``): one BOS,
the prompt (ChatML with the generation prompt when conversational), the completion, and
EOS after a plain-string completion. Unlike SFT, which tokenizes the joined text (as TRL's
SFTTrainer does), the prompt and each completion are tokenized apart and concatenated (TRL's
DPO/KTO ``tokenize_row``), so chosen, rejected and KTO's mismatched rows share exactly the
same prompt tokens. Labels are -100 on the prompt, so ``sequence_logprobs`` scores exactly
the completion's tokens.

A bad record (chosen identical to rejected, an empty completion, a label that is not a
boolean, a margin that is not a finite number, a prompt that leaves no room for a completion within ``max_length``) is an
``InputError`` naming the file and line, or is skipped and counted with ``on_bad: skip``.
A completion running past ``max_length`` is truncated (TRL's keep_start), skipped or an
error, by ``on_too_long``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmforge.core.io import InputError
from lmforge.data.chat import (
    IGNORE_INDEX,
    OnBad,
    OnTooLong,
    example_segments,
    read_sft_records,
    tokenize_segments,
)
from lmforge.data.chatml import ExampleError, Segment
from lmforge.data.documents import SkipLog
from lmforge.data.tokenizer import Tokenizer


@dataclass
class Completion:
    """One prompt + completion, tokenized; ``labels`` are -100 over the prompt."""

    input_ids: list[int]
    labels: list[int]
    prompt_len: int  # tokens before the first completion token (BOS included)


@dataclass
class PreferencePair:
    chosen: Completion
    rejected: Completion
    source: str  # file:line
    margin: float | None = None  # how much better chosen is (a reward model's Bradley-Terry margin)


@dataclass
class UnpairedExample:
    completion: Completion
    desirable: bool
    source: str


# -- parsing one record


def _content_is_empty(completion: Any) -> bool:
    if isinstance(completion, str):
        return not completion.strip()
    if isinstance(completion, list):
        return not any(isinstance(m, dict) and str(m.get("content", "")).strip() for m in completion)
    return False


def finite(number: int | float) -> bool:
    """Whether ``number`` is a float other than NaN and infinity (an int too large for a float is not)."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def split_implicit_prompt(chosen: list, rejected: list) -> tuple[list, list, list]:
    """(prompt, chosen, rejected) of two conversations: the prompt is their longest shared prefix of turns."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n > 0 and isinstance(chosen[n - 1], dict) and chosen[n - 1].get("role") == "assistant":  # completions start with the assistant's turn
        n -= 1
    if n == 0:
        raise ExampleError("no_prompt", "no 'prompt', and 'chosen' and 'rejected' share no leading turns to use as one")
    return chosen[:n], chosen[n:], rejected[n:]


def completion_segments(prompt: Any, completion: Any, what: str) -> tuple[list[Segment], list[Segment], bool]:
    """(prompt segments, completion segments, whether EOS is appended) of a validated record.

    The prompt ends where training starts: after the plain prompt, or after the generation
    prompt ``<|im_start|>assistant\\n`` of a conversational one, so every completion of one
    prompt shares the same prompt segments.
    """
    if _content_is_empty(completion):
        raise ExampleError("empty_completion", f"{what!r} is empty")
    segments, add_eos = example_segments({"prompt": prompt, "completion": completion})
    first = next(i for i, (_, trained) in enumerate(segments) if trained)
    return segments[:first], segments[first:], add_eos


def tokenize_prompt(tok: Tokenizer, segments: Sequence[Segment], max_length: int, what: str) -> list[int]:
    """``[BOS] + encode(prompt)``; raises ``ExampleError`` when it leaves no room for ``what`` within ``max_length``."""
    ids, _ = tokenize_segments(tok, segments)
    if len(ids) >= max_length:
        raise ExampleError("prompt_too_long",
                           f"the prompt takes {len(ids)} tokens, leaving no room for {what!r} within "
                           f"max_length={max_length}")
    return ids


def append_completion(tok: Tokenizer, prompt_ids: list[int], segments: Sequence[Segment], add_eos: bool,
                      max_length: int, what: str, on_too_long: OnTooLong) -> tuple[Completion, str | None]:
    """The prompt's ids followed by the completion tokenized on its own (TRL's ``tokenize_row``).

    Tokenizing the two apart keeps the boundary where the text has it: a prompt ending in a
    space gives every completion the same prompt tokens, instead of the space merging into
    one completion's first token and not another's. Returns (completion, "truncated" or None);
    raises ``ExampleError`` (``on_too_long='error'``/``'skip'``) when it does not fit.
    """
    ids, labels = tokenize_segments(tok, segments, add_eos, add_bos=False)
    ids, labels = prompt_ids + ids, [IGNORE_INDEX] * len(prompt_ids) + labels
    if len(ids) <= max_length:
        return Completion(ids, labels, len(prompt_ids)), None
    detail = f"{what!r} makes {len(ids)} tokens, more than max_length={max_length}"
    if on_too_long != "truncate":
        raise ExampleError("too_long", detail)
    return Completion(ids[:max_length], labels[:max_length], len(prompt_ids)), "truncated"


def tokenize_completion(tok: Tokenizer, prompt: Any, completion: Any, max_length: int, what: str,
                        on_too_long: OnTooLong) -> tuple[Completion | None, str | None]:
    """Tokenize prompt + completion; returns (completion, note) where note is "truncated" or None.

    Raises ``ExampleError`` for an invalid record, an empty completion, a prompt that fills
    ``max_length``, or (``on_too_long='error'``/``'skip'``) a completion that does not fit.
    """
    prompt_segments, segments, add_eos = completion_segments(prompt, completion, what)
    prompt_ids = tokenize_prompt(tok, prompt_segments, max_length, what)
    return append_completion(tok, prompt_ids, segments, add_eos, max_length, what, on_too_long)


def parse_pair(tok: Tokenizer, record: Any, max_length: int, on_too_long: OnTooLong) -> tuple[PreferencePair, bool]:
    """A validated, tokenized pair and whether a side was truncated (raises ``ExampleError``)."""
    if not isinstance(record, dict):
        raise ExampleError("not_an_object", f"expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise ExampleError("unknown_format", f"a preference pair needs 'chosen' and 'rejected' (and usually "
                                             f"'prompt'); missing {missing}, got keys {sorted(record)[:8]}")
    chosen, rejected = record["chosen"], record["rejected"]
    if "prompt" in record:
        prompt = record["prompt"]
    elif isinstance(chosen, list) and isinstance(rejected, list):
        prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
    else:
        raise ExampleError("no_prompt", "plain-text pairs need a 'prompt' field")
    if chosen == rejected:
        raise ExampleError("identical_pair", "'chosen' and 'rejected' are identical, so there is no preference")
    prompt_segments, c_segments, c_eos = completion_segments(prompt, chosen, "chosen")
    _, r_segments, r_eos = completion_segments(prompt, rejected, "rejected")  # the same prompt segments
    prompt_ids = tokenize_prompt(tok, prompt_segments, max_length, "chosen")  # one tokenization, shared by both
    c, c_note = append_completion(tok, prompt_ids, c_segments, c_eos, max_length, "chosen", on_too_long)
    r, r_note = append_completion(tok, prompt_ids, r_segments, r_eos, max_length, "rejected", on_too_long)
    if c.input_ids == r.input_ids:
        raise ExampleError("identical_pair", f"'chosen' and 'rejected' are identical within max_length={max_length}")
    margin = record.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, int | float)):
        raise ExampleError("bad_margin", f"'margin' must be a number, got {margin!r}")
    if margin is not None and not finite(margin):  # a JSONL line can't hold NaN or infinity; a Parquet row can
        raise ExampleError("bad_margin", f"'margin' must be a finite number, got {margin!r}")
    return PreferencePair(c, r, "", None if margin is None else float(margin)), bool(c_note or r_note)


def parse_unpaired(tok: Tokenizer, record: Any, max_length: int,
                   on_too_long: OnTooLong) -> tuple[UnpairedExample, bool]:
    """A validated, tokenized KTO example and whether it was truncated (raises ``ExampleError``)."""
    if not isinstance(record, dict):
        raise ExampleError("not_an_object", f"expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("prompt", "completion", "label") if k not in record]
    if missing:
        raise ExampleError("unknown_format", f"an unpaired example needs 'prompt', 'completion' and 'label'; "
                                             f"missing {missing}")
    label = record["label"]
    if not isinstance(label, bool):
        raise ExampleError("bad_label", f"'label' must be true or false, got {label!r}")
    c, note = tokenize_completion(tok, record["prompt"], record["completion"], max_length, "completion", on_too_long)
    return UnpairedExample(c, label, ""), bool(note)


# -- reading files


def _read(paths: list[str], parse, tok: Tokenizer, max_length: int, on_bad: OnBad, on_too_long: OnTooLong,
          skipped: SkipLog) -> Iterator:
    for where, record in read_sft_records(paths):
        try:
            if isinstance(record, ExampleError):
                raise record
            example, truncated = parse(tok, record, max_length, on_too_long)
        except ExampleError as exc:
            too_long = exc.reason == "too_long"
            if (on_too_long == "error") if too_long else (on_bad == "error"):
                hint = "raise max_length, or set on_too_long: truncate or skip" if too_long else \
                    "set on_bad: skip to skip and count such examples"
                raise InputError(f"{where}: {exc} ({hint})") from exc
            skipped.add(exc.reason, where, str(exc))
            continue
        if truncated:
            skipped.add("truncated", where, f"truncated to max_length={max_length}")
        example.source = where
        yield example


def read_preference_pairs(paths: list[str], tok: Tokenizer, max_length: int, *, on_bad: OnBad = "error",
                          on_too_long: OnTooLong = "truncate", skipped: SkipLog | None = None) -> list[PreferencePair]:
    """Tokenized ``prompt``/``chosen``/``rejected`` pairs of JSONL/Parquet files."""
    skipped = skipped if skipped is not None else SkipLog()
    return list(_read(paths, parse_pair, tok, max_length, on_bad, on_too_long, skipped))


def read_unpaired_examples(paths: list[str], tok: Tokenizer, max_length: int, *, on_bad: OnBad = "error",
                           on_too_long: OnTooLong = "truncate",
                           skipped: SkipLog | None = None) -> list[UnpairedExample]:
    """Tokenized ``prompt``/``completion``/``label`` examples of JSONL/Parquet files."""
    skipped = skipped if skipped is not None else SkipLog()
    return list(_read(paths, parse_unpaired, tok, max_length, on_bad, on_too_long, skipped))


# -- padded rows


def pad_rows(completions: Sequence[Completion], pad_id: int, length: int | None = None,
             side: str = "right") -> dict[str, torch.Tensor]:
    """(N, T) ``input_ids``, ``labels`` (-100 on prompt and padding) and ``attention_mask``.

    Right padding needs no attention mask (causal attention never looks ahead at the
    pads); left padding does, together with positions counted from the first real token.
    """
    if side not in ("right", "left"):
        raise ValueError(f"padding side must be 'right' or 'left', got {side!r}")
    length = length or max(len(c.input_ids) for c in completions)
    ids = torch.full((len(completions), length), pad_id, dtype=torch.long)
    labels = torch.full((len(completions), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(completions), length), dtype=torch.long)
    for i, c in enumerate(completions):
        n = len(c.input_ids)
        if n > length:
            raise ValueError(f"row {i} has {n} tokens, more than the padded length {length}")
        cols = slice(0, n) if side == "right" else slice(length - n, length)
        ids[i, cols] = torch.tensor(c.input_ids)
        labels[i, cols] = torch.tensor(c.labels)
        mask[i, cols] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pair_rows(pairs: Sequence[PreferencePair], pad_id: int, length: int | None = None,
              side: str = "right") -> dict[str, torch.Tensor]:
    """``chosen_*`` and ``rejected_*`` rows of the pairs, padded to one length, and ``margin``
    when any pair has one (0 for the others)."""
    length = length or max(max(len(p.chosen.input_ids), len(p.rejected.input_ids)) for p in pairs)
    chosen = pad_rows([p.chosen for p in pairs], pad_id, length, side)
    rejected = pad_rows([p.rejected for p in pairs], pad_id, length, side)
    rows = {**{f"chosen_{k}": v for k, v in chosen.items()}, **{f"rejected_{k}": v for k, v in rejected.items()}}
    if any(p.margin is not None for p in pairs):
        rows["margin"] = torch.tensor([p.margin or 0.0 for p in pairs], dtype=torch.float32)
    return rows


def mismatched_completion(prompt: Completion, other: Completion, max_length: int) -> Completion:
    """``prompt``'s prompt followed by ``other``'s completion: a sample y' for KTO's KL baseline."""
    ids = prompt.input_ids[: prompt.prompt_len] + other.input_ids[other.prompt_len:]
    labels = [IGNORE_INDEX] * prompt.prompt_len + other.labels[other.prompt_len:]
    return Completion(ids[:max_length], labels[:max_length], prompt.prompt_len)


def unpaired_rows(examples: Sequence[UnpairedExample], pad_id: int, max_length: int, seed: int = 0,
                  side: str = "right") -> dict[str, torch.Tensor]:
    """KTO rows: the examples, their ``desirable`` flags, and ``kl_*`` rows for the KL baseline.

    Example i's KL row pairs its prompt with the completion of the next example in a seeded
    shuffle of the data (TRL rotates completions by one within each batch; a shuffle keeps
    neighbouring examples of one prompt from being paired with each other). Built once, so
    the reference's KL log-probs can be precomputed too.
    """
    if len(examples) < 2:
        raise InputError("KTO needs at least 2 examples: the KL baseline pairs prompts with other examples' completions")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    partner = {order[j]: order[(j + 1) % len(order)] for j in range(len(order))}
    completions = [e.completion for e in examples]
    kl = [mismatched_completion(completions[i], completions[partner[i]], max_length) for i in range(len(examples))]
    length = max(max(len(c.input_ids) for c in completions), max(len(c.input_ids) for c in kl))
    rows = pad_rows(completions, pad_id, length, side)
    rows["desirable"] = torch.tensor([e.desirable for e in examples], dtype=torch.bool)
    rows.update({f"kl_{k}": v for k, v in pad_rows(kl, pad_id, length, side).items()})
    return rows
