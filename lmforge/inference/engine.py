"""The generation engine: requests in, completions out, with a KV cache and continuous batching.

Requests wait in a queue; up to ``max_batch`` rows decode together. A request's prompt is
prefilled once and its cache rows copied for its ``n`` samples. A row that finishes (a stop
token, a stop string, ``max_new_tokens``) leaves the batch at once: its cache rows are dropped
and it is not computed again, and the freed slots take the next waiting requests, whose
prefilled caches join the batch's. Every step runs the model's own forward
(``Transformer.forward`` with a ``KVCache``), on a decoding layout of the same modules
(``model.fused``) when the model is plain.

The batch's cache is right-aligned: all rows write the same column each step, a row that
joined with a shorter history is padded on the left, and an attention mask hides the
padding while each row's RoPE positions count from its own first token, so every row
computes what it would alone. A batch with no padding takes the plain path (no mask, no
position tables). A model whose every layer has a sliding window decodes into a ring of
``sliding_window`` slots (``KVCache``): the key mask then follows the ring's slots, and a slot
overwritten by a new token becomes a real key.

Each generated token comes with its log-probability under the model (log-softmax of the
raw logits in float32, temperature 1, before any penalty or truncation), and optionally the
``top_logprobs`` most likely alternatives: what a training forward of prompt + completion
gives for the same tokens, so an RL sampler and its trainer agree. With ``prompt_logprobs`` the
prefill's forward also gives every prompt token's log-probability (the head over all of its
positions, not only the last), which is what scoring a text needs (an ``echo`` completion).

A server streams and cancels through the same engine: a request's ``on_token`` is called with
each token as it is chosen, and ``cancel`` drops a request from the queue or the batch. A
request is checked when submitted (token ids in the vocabulary, a seed the generator takes,
prompt + max_new_tokens within the context); an error that still comes from one request (its
seed, its prefill, its callback, its stop strings) fails that request alone: it leaves the
batch, ``take_failures`` reports it, and the other rows decode on as if it had never been there.

    results = generate(model, [[bos, *tok.encode("Once upon")]], GenerationConfig(temperature=0), tok)
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from lmforge.core.config import at_least, in_range, positive, seed_field, unit_interval
from lmforge.data.tokenizer import Tokenizer
from lmforge.inference.sampling import repetition_penalty, sample_next_token
from lmforge.inference.speculative import Drafter, accepted_count
from lmforge.model.fused import fused_copy, is_plain, onednn_packs
from lmforge.model.kv_cache import KV_CACHE_DTYPES, KVCache, ring_capacity, slot_times
from lmforge.model.mtp import mtp_modules
from lmforge.model.transformer import positions_and_mask

FinishReason = Literal["stop", "length"]
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


@dataclass
class GenerationConfig:
    """How to pick tokens and when to stop."""

    max_new_tokens: int = positive(128)
    temperature: float = at_least(0, 1.0)  # 0 = greedy
    top_k: int = at_least(0, 0)  # 0 = off
    top_p: float = unit_interval(1.0, low_open=True)  # 1 = off
    min_p: float = unit_interval(0.0)  # 0 = off
    repetition_penalty: float = positive(1.0)  # 1 = off
    stop: list[str] = field(default_factory=list)  # the text is cut before the first one found
    stop_token_ids: list[int] | None = at_least(0, None)  # None = the tokenizer's EOS; [] = never stop early
    seed: int | None = seed_field(None)  # None = torch's global generator
    n: int = positive(1)  # samples per prompt, sharing the prompt's prefill
    top_logprobs: int = in_range(0, 0, 20)  # alternatives returned with each token's log-probability
    prompt_logprobs: bool = False  # also each prompt token's log-probability (and top_logprobs alternatives)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.n < 1:
            raise ValueError(f"max_new_tokens and n must be >= 1, got {self.max_new_tokens} and {self.n}")
        if self.temperature < 0.0 or self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(
                f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got {self.temperature}, {self.top_k}, {self.top_p}"
            )
        if not 0.0 <= self.min_p <= 1.0 or self.repetition_penalty <= 0 or self.top_logprobs < 0:
            raise ValueError(f"need 0 <= min_p <= 1, repetition_penalty > 0 and top_logprobs >= 0; got "
                             f"{self.min_p}, {self.repetition_penalty}, {self.top_logprobs}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed {self.seed} is outside [-2^63, 2^64 - 1], what torch's generator takes")


@dataclass
class Generation:
    """One sample's continuation of a prompt.

    ``tokens`` excludes a stop token and includes the token that completed a stop string;
    ``text`` (when a tokenizer was given) is cut before the stop string. ``logprobs[i]`` is
    the model's log-probability of ``tokens[i]``; ``top_logprobs[i]`` the most likely
    (token, log-probability) pairs at that step when asked for. ``stop_token`` is the stop
    token that ended it, with its log-probability and alternatives (None otherwise).
    ``prompt_logprobs[i]`` (when asked for) is that of ``prompt_tokens[i + 1]`` given those
    before it, ``prompt_top_logprobs[i]`` the alternatives at that position.
    """

    prompt_tokens: list[int]
    tokens: list[int]
    finish_reason: FinishReason
    text: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stop_token: tuple[int, float, list[tuple[int, float]] | None] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


TokenCallback = Callable[[int, int, float, "list[tuple[int, float]] | None"], None]


@dataclass
class Request:
    """A prompt (token ids) and how to continue it; ``generator`` overrides ``config.seed``.
    ``on_token(sample, token, logprob, top)`` is called, on the thread running the engine, with
    each token a sample keeps as it is chosen (not a stop token, nor the token that completes a
    stop string: the final text is cut before that string): what streaming sends."""

    prompt: Sequence[int]
    config: GenerationConfig
    generator: torch.Generator | None = None
    on_token: TokenCallback | None = None


# --------------------------------------------------------------------------- the decoding layout


_decoding_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (weights fingerprint, copy)


def decoding_view(model: nn.Module) -> nn.Module:
    """The module generation runs: for a plain model its decoding layout (``fused_copy``),
    rebuilt when a parameter or buffer has changed since the last call (moved, cast, loaded or
    stepped); a LoRA, NF4 or sharded model itself. Either way ``Transformer.forward`` runs."""
    if not is_plain(model):
        return model
    weight = model.embed.weight
    pack = onednn_packs(weight.dtype, weight.device)
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    if any(t.is_inference() for t in tensors):  # inference tensors keep no version counter: rebuild every call
        return fused_copy(model, pack)
    fingerprint = [(t.data_ptr(), t._version, t.dtype) for t in tensors]
    cached = _decoding_models.get(model)
    if cached is None or cached[0] != fingerprint:
        cached = (fingerprint, fused_copy(model, pack))
        _decoding_models[model] = cached
    return cached[1]


def release_decoding_view(model: nn.Module) -> None:
    """Drop the cached decoding layout of ``model``: its joined matrices cost memory, so a caller
    that goes back to training the model releases it first."""
    _decoding_models.pop(model, None)


# --------------------------------------------------------------------------- the batch's cache


@dataclass
class Batch:
    """The active rows' decoding state, one entry per row."""

    cache: KVCache
    key_mask: torch.Tensor | None  # (B, capacity) True at real keys and at every column still to write; None = no padding
    next_positions: torch.Tensor  # (B, 1) RoPE position of each row's next token
    logits: torch.Tensor  # (B, V) each row's next-token logits
    hidden: torch.Tensor | None = None  # (B, T, d) the prefill's final hidden states, kept for MTP drafting

    def select(self, rows: torch.Tensor) -> Batch:
        """The rows ``rows`` (a row may repeat: ``n`` samples of one prompt), in that order."""
        cache = self.cache.select(rows)
        key_mask = self.key_mask.index_select(0, rows) if self.key_mask is not None else None
        next_positions = self.next_positions.index_select(0, rows)
        hidden = self.hidden.index_select(0, rows) if self.hidden is not None else None
        return Batch(cache, unpadded(key_mask, cache, next_positions), next_positions, self.logits.index_select(0, rows),
                     hidden)

    def spans(self) -> torch.Tensor:
        """(B,) the real keys each row holds: from its first real key to the cache's end (on a ring, the slots' real ones)."""
        written = min(self.cache.length, self.cache.capacity)
        if self.key_mask is None:
            return torch.full((self.logits.shape[0],), written, device=self.logits.device)
        return self.key_mask[:, :written].sum(dim=1)


def unpadded(key_mask: torch.Tensor | None, cache: KVCache, next_positions: torch.Tensor) -> torch.Tensor | None:
    """None when no row has padding in the written columns and every row's positions are the
    cache's columns (the plain path), else ``key_mask``. On a ring the padding slots are
    overwritten in time, but a row that had padding keeps positions behind the columns."""
    if key_mask is None:
        return None
    written = min(cache.length, cache.capacity)
    plain = bool(key_mask[:, :written].all()) and bool((next_positions == cache.length).all())
    return None if plain else key_mask


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one (B, T) tensor padded on the left, and each prompt's length (B,)."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
    return tokens.to(device), torch.tensor([len(p) for p in prompts], device=device)


PromptScores = tuple[list[float], list[list[tuple[int, float]]] | None]


def prefill(model: nn.Module, prompts: Sequence[Sequence[int]], extra: int, kv_cache_dtype: str = "auto") -> Batch:
    """Run the prompts through the model into a fresh cache (the model's ``new_kv_cache``, stored as
    ``kv_cache_dtype``) with room for ``extra`` more tokens."""
    return scored_prefill(model, prompts, extra, kv_cache_dtype=kv_cache_dtype)[0]


def scored_prefill(model: nn.Module, prompts: Sequence[Sequence[int]], extra: int,
                   score: dict[int, int] | None = None, kv_cache_dtype: str = "auto",
                   keep_hidden: bool = False) -> tuple[Batch, dict[int, PromptScores]]:
    """``prefill``, and for each prompt numbered in ``score`` (prompt index -> alternatives wanted)
    each prompt token's log-probability, from the head over every position of the same forward;
    ``keep_hidden``: the batch keeps the forward's hidden states (what MTP drafting starts from)."""
    param = model.embed.weight
    tokens, lengths = left_pad(prompts, 0, param.device)
    B, T = tokens.shape
    cache = model.new_kv_cache(B, T + extra, param.dtype, param.device, kv_cache_dtype)
    if all(len(p) == T for p in prompts):
        hidden = model.hidden_states(tokens, kv_cache=cache)
        key_mask = None
    else:
        real = torch.arange(T, device=param.device)[None] >= (T - lengths)[:, None]  # (B, T): padding False
        positions, mask = positions_and_mask(real)
        hidden = model.hidden_states(tokens, positions=positions, attn_mask=mask, kv_cache=cache)
        # (B, capacity), by the time each slot holds: padding False, every slot after the prompt True
        key_mask = slot_times(T, cache.capacity, param.device)[None] >= (T - lengths)[:, None]
    # The head over the last position only: the model's forward is hidden_states then lm_head.
    batch = Batch(cache, key_mask, lengths[:, None].clone(), model.logits(hidden[:, -1]), hidden if keep_hidden else None)
    return batch, {i: prompt_scores(model, hidden[i, T - len(prompts[i]) : -1], tokens[i, T - len(prompts[i]) + 1 :], top)
                   for i, top in (score or {}).items()}


def prompt_scores(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, top: int) -> PromptScores:
    """log p(targets[t] | the tokens up to t) from the hidden states (T-1, D) before each target."""
    logprobs = torch.log_softmax(model.logits(hidden).float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
    if not top:
        return chosen, None
    values, ids = logprobs.topk(top, dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def merge(a: Batch, b: Batch, extra: int) -> Batch:
    """One batch of ``a``'s rows then ``b``'s, right-aligned on the longest history, with room
    for ``extra`` more tokens; columns no row still reads are dropped."""
    spans = torch.cat((a.spans(), b.spans()))
    width = int(spans.max())
    capacity = ring_capacity(width + extra, a.cache.window)
    key_mask = torch.zeros(len(spans), capacity, dtype=torch.bool, device=spans.device)
    key_mask[:, width:] = True
    start = 0
    for part in (a, b):
        rows = slice(start, start + part.logits.shape[0])
        n = min(part.cache.length, part.cache.capacity, width)
        key_mask[rows, width - n : width] = True if part.key_mask is None else part.key_mask[:, part.cache.recent_columns(n)]
        start = rows.stop
    cache, next_positions = a.cache.merged(b.cache, width, capacity), torch.cat((a.next_positions, b.next_positions))
    return Batch(cache, unpadded(key_mask, cache, next_positions), next_positions, torch.cat((a.logits, b.logits)))


def decode_step(model: nn.Module, tokens: torch.Tensor, batch: Batch) -> None:
    """Feed one new token per row (B,) through the model's forward; the next logits go to ``batch.logits``."""
    if batch.key_mask is None:
        logits = model(tokens[:, None], kv_cache=batch.cache)
    else:
        cache = batch.cache
        if cache.wraps(1):  # the ring's oldest slot takes this real token
            batch.key_mask[:, cache.length % cache.capacity] = True
        end = min(cache.length + 1, cache.capacity)
        logits = model(tokens[:, None], positions=batch.next_positions, attn_mask=batch.key_mask[:, None, None, :end],
                       kv_cache=batch.cache)
    batch.next_positions += 1
    batch.logits = logits[:, -1]


# --------------------------------------------------------------------------- the engine


@dataclass
class Row:
    """One sample being generated."""

    request: int
    sample: int
    prompt: list[int]
    config: GenerationConfig
    generator: torch.Generator | None
    stop_ids: set[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    text: str | None = None
    finish: FinishReason | None = None
    on_token: TokenCallback | None = None
    stop_token: tuple[int, float, list[tuple[int, float]] | None] | None = None
    prompt_scores: PromptScores | None = None
    seen: torch.Tensor | None = None  # (V,) True at every token of prompt + tokens; only with a repetition penalty


@dataclass
class RowSettings:
    """The batch rows' sampling settings as (B,) tensors, built when rows join or leave rather than every step."""

    greedy: bool  # every row at temperature 0
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    penalty: torch.Tensor | None  # None when no row has a repetition penalty
    top_logprobs: int  # the most alternatives a row asks for

    @classmethod
    def of(cls, rows: Sequence[Row], device: torch.device) -> RowSettings:
        configs = [r.config for r in rows]

        def setting(name: str) -> torch.Tensor:
            return torch.tensor([getattr(c, name) for c in configs], device=device)

        penalized = any(c.repetition_penalty != 1.0 for c in configs)
        return cls(all(c.temperature == 0 for c in configs), setting("temperature"), setting("top_k"), setting("top_p"),
                   setting("min_p"), setting("repetition_penalty") if penalized else None,
                   max(c.top_logprobs for c in configs))


def check_drafting(model: nn.Module, draft_tokens: int, max_batch: int) -> None:
    """Why ``model`` cannot draft ``draft_tokens`` tokens a step (a ValueError), if it cannot."""
    if draft_tokens < 0:
        raise ValueError(f"draft_tokens must be >= 0, got {draft_tokens}")
    if not draft_tokens:
        return
    modules = mtp_modules(model)
    depth = len(modules) if modules is not None else 0
    if draft_tokens > depth:
        raise ValueError(f"draft_tokens = {draft_tokens} needs a model with at least {draft_tokens} multi-token prediction "
                         f"modules (model.mtp.depth); this one has {depth}")
    if max_batch != 1:
        raise ValueError(f"draft_tokens decodes one row at a time (the rows of a batch accept different numbers of "
                         f"drafts): max_batch must be 1, got {max_batch}")


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Where the earliest of ``stops`` starts in ``text``, or -1."""
    return min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)


class Engine:
    """Continuous batching over a queue: ``submit`` requests, then iterate ``run()`` for
    ``(request id, its n generations)`` as each request finishes (not in submission order)."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer | None = None, max_batch: int = 64,
                 kv_cache_dtype: str = "auto", draft_tokens: int = 0):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        check_drafting(model, draft_tokens, max_batch)
        self.model, self.tokenizer, self.max_batch, self.kv_cache_dtype = model, tokenizer, max_batch, kv_cache_dtype
        self.draft_tokens = draft_tokens  # self-speculative decoding with the model's MTP modules (``speculative``)
        self.drafter: Drafter | None = None  # the decoding row's, while drafting
        self.draft_stats = [0, 0]  # drafts verified, and accepted, over the engine's life
        self.net = decoding_view(model)
        self.queue: deque[tuple[int, Request]] = deque()
        self.rows: list[Row] = []
        self.batch: Batch | None = None
        self.settings: RowSettings | None = None  # self.rows' settings
        self.done: dict[int, list[Row]] = {}
        self.ids = itertools.count()
        self.cancelled: set[int] = set()  # requests with rows still in the batch, to drop at the next step
        self.failures: dict[int, Exception] = {}  # request id -> what failed it, until take_failures

    def submit(self, request: Request) -> int:
        """Queue a request; returns its id. Bad requests are refused here, before any work."""
        cfg, prompt = request.config, request.prompt
        if len(prompt) == 0:
            raise ValueError("every prompt needs at least one token (add a BOS token to an empty prompt)")
        if cfg.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the text")
        vocab = self.model.cfg.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"the prompt has token ids outside the vocabulary [0, {vocab}): "
                             f"{[t for t in prompt if not 0 <= t < vocab][:5]}")
        max_len = self.model.cfg.max_seq_len
        if len(prompt) + cfg.max_new_tokens > max_len:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens plus max_new_tokens ({cfg.max_new_tokens}) exceeds the model's "
                f"max_seq_len {max_len}; shorten the prompt or lower max_new_tokens"
            )
        if self.draft_tokens and (cfg.temperature != 0 or cfg.n != 1 or cfg.repetition_penalty != 1.0):
            raise ValueError("draft_tokens verifies greedy choices: it needs temperature 0, n 1 and no repetition "
                             f"penalty (got temperature {cfg.temperature}, n {cfg.n}, repetition_penalty "
                             f"{cfg.repetition_penalty}); set draft_tokens to 0 to sample")
        request_id = next(self.ids)
        self.queue.append((request_id, request))
        return request_id

    def cancel(self, request_id: int) -> None:
        """Forget a request: out of the queue now, or its rows out of the batch at the next step
        (their slots free for waiting requests); it is never returned. Unknown or finished ids are ignored."""
        waiting = len(self.queue)
        self.queue = deque((i, r) for i, r in self.queue if i != request_id)
        if len(self.queue) == waiting and any(row.request == request_id for row in self.rows):
            self.cancelled.add(request_id)
        self.done.pop(request_id, None)

    def fail(self, request_id: int, error: Exception) -> None:
        """Fail one request alone: it leaves the queue or the batch (its rows at once, within the
        step), and ``take_failures`` reports it; the other requests are not touched."""
        self.failures.setdefault(request_id, error)
        self.cancel(request_id)

    def take_failures(self) -> list[tuple[int, Exception]]:
        """The requests failed since the last call, with their errors; they are never returned by ``step``."""
        failures, self.failures = list(self.failures.items()), {}
        return failures

    @property
    def active(self) -> int:
        """Requests waiting or decoding."""
        return len(self.queue) + len({row.request for row in self.rows} - self.cancelled)

    def run(self) -> Iterator[tuple[int, list[Generation]]]:
        """Decode until the queue and the batch are empty, yielding each request as it finishes."""
        with torch.inference_mode():
            while self.queue or self.rows:
                yield from self.step()
                for _, error in self.take_failures():
                    raise error

    def step(self) -> list[tuple[int, list[Generation]]]:
        """Admit waiting requests into free slots, choose every row's next token, let finished rows
        leave, and run one decode step for the rest; returns the requests that finished."""
        self.drop_cancelled()
        self.admit()
        if not self.rows:
            return []
        tokens = self.choose_tokens()
        failed = self.cancelled  # requests a row of which failed while choosing its token
        keep = [i for i, row in enumerate(self.rows) if row.finish is None and row.request not in failed]
        finished = [row for row in self.rows if row.finish is not None and row.request not in failed]
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, dtype=torch.long, device=tokens.device)
            self.rows = [self.rows[i] for i in keep]
            self.batch = self.batch.select(index) if keep else None
            self.settings = RowSettings.of(self.rows, tokens.device) if keep else None
            tokens = tokens.index_select(0, index)
        if self.rows and self.drafter is not None:
            finished += self.speculate(tokens)
        elif self.rows:
            decode_step(self.net, tokens, self.batch)
        return self.collect(finished)

    def speculate(self, tokens: torch.Tensor) -> list[Row]:
        """One round of self-speculative decoding of the one row (``speculative``): the MTP modules draft,
        the model verifies t_n and the drafts in one forward, the accepted drafts are recorded as
        ``choose_tokens`` records (with their log-probabilities), and the cache keeps the accepted positions.
        Returns the row if a draft finished it (it leaves the batch)."""
        row, batch, drafter = self.rows[0], self.batch, self.drafter
        cache = batch.cache
        n = cache.length
        room = min(row.config.max_new_tokens - len(row.tokens), self.model.cfg.max_seq_len - n) - 1
        if room < 1:  # no room for a draft before the row's last token: one plain step
            decode_step(self.net, tokens, batch)
            return []
        drafts = drafter.draft(self.net, row.prompt + row.tokens)[:room]
        ids = torch.cat((tokens, torch.tensor(drafts, device=tokens.device)))[None]
        hidden = self.net.hidden_states(ids, kv_cache=cache)
        logits = self.net.logits(hidden)[0]  # (1 + drafts, V): logits[i] chooses the token after ids[i]
        accepted = accepted_count(ids[0, 1:], logits)
        logprobs = torch.log_softmax(logits[:accepted].float(), dim=-1)
        k = self.settings.top_logprobs
        for i, token in enumerate(drafts[:accepted]):
            top = logprobs[i].topk(k) if k else None
            self.record(row, token, float(logprobs[i, token]), (top.indices, top.values) if k else None)
            if row.finish is not None:
                break
        cache.length = n + accepted + 1  # t_n and the accepted drafts; the rest is written over
        batch.next_positions += accepted + 1
        batch.logits = logits[accepted : accepted + 1]
        drafter.verified(hidden[:, : accepted + 1], len(drafts), accepted)
        self.draft_stats[0] += len(drafts)
        self.draft_stats[1] += accepted
        if row.finish is None:
            return []
        self.rows, self.batch, self.settings, self.drafter = [], None, None, None
        return [row]

    def drop_cancelled(self) -> None:
        """Take the rows of cancelled requests out of the batch."""
        if not self.cancelled:
            return
        keep = [i for i, row in enumerate(self.rows) if row.request not in self.cancelled]
        self.cancelled.clear()
        if len(keep) < len(self.rows):
            self.rows = [self.rows[i] for i in keep]
            device = self.batch.logits.device
            self.batch = self.batch.select(torch.tensor(keep, dtype=torch.long, device=device)) if keep else None
            self.settings = RowSettings.of(self.rows, device) if keep else None

    def admit(self) -> None:
        """Move waiting requests into the batch while their rows fit (a request always fits an empty batch)."""
        taken: list[tuple[int, Request]] = []
        while self.queue:
            n = self.queue[0][1].config.n
            if (self.rows or taken) and len(self.rows) + sum(r.config.n for _, r in taken) + n > self.max_batch:
                break
            taken.append(self.queue.popleft())
        if not taken:
            return
        device = self.model.embed.weight.device
        starts = []  # (request id, request, generator, stop ids) of the requests that could start
        for request_id, request in taken:
            try:
                starts.append((request_id, request, *self.start(request, device)))
            except Exception as exc:  # noqa: BLE001 - one request's failure fails it alone
                self.fail(request_id, exc)
        if not starts:
            return
        extra = max([r.config.max_new_tokens for _, r, *_ in starts] + [r.config.max_new_tokens for r in self.rows]) - 1
        starts, (fresh, scores) = self.isolated_prefill(starts, 0 if self.rows else extra)
        if not starts:
            return
        if self.draft_tokens:  # one row at a time (check_drafting): its drafter starts from the prefill
            self.drafter = Drafter(self.net, self.draft_tokens, fresh.hidden, fresh.cache.capacity, self.kv_cache_dtype)
            fresh.hidden = None
        taken = [(request_id, request) for request_id, request, *_ in starts]
        new_rows = []
        for index, (request_id, request, generator, stop_ids) in enumerate(starts):
            cfg = request.config
            for sample in range(cfg.n):
                row = Row(request_id, sample, list(request.prompt), cfg, generator, set(stop_ids),
                          top_logprobs=[] if cfg.top_logprobs else None, on_token=request.on_token,
                          prompt_scores=scores.get(index))
                if cfg.repetition_penalty != 1.0:
                    row.seen = torch.zeros(self.model.cfg.vocab_size, dtype=torch.bool, device=device)
                    row.seen[torch.tensor(row.prompt, device=device)] = True
                new_rows.append(row)
        copies = torch.tensor([r.config.n for _, r in taken], device=device)
        if bool((copies > 1).any()):  # n samples of a prompt: copies of its one prefill
            fresh = fresh.select(torch.arange(len(taken), device=device).repeat_interleave(copies))
        if self.rows:
            extra = max(r.config.max_new_tokens - len(r.tokens) for r in new_rows + self.rows) - 1
            fresh = merge(self.batch, fresh, extra)
        self.rows, self.batch = self.rows + new_rows, fresh
        self.settings = RowSettings.of(self.rows, device)

    def start(self, request: Request, device: torch.device) -> tuple[torch.Generator | None, list[int]]:
        """A request's generator (``config.seed``'s unless it brings one) and stop token ids."""
        cfg = request.config
        generator = request.generator
        if generator is None and cfg.seed is not None:
            generator = torch.Generator(device).manual_seed(cfg.seed)
        stop_ids = cfg.stop_token_ids
        if stop_ids is None:
            stop_ids = [self.tokenizer.eos_id] if self.tokenizer is not None else []
        return generator, stop_ids

    def isolated_prefill(self, starts: list, extra: int) -> tuple[list, tuple[Batch | None, dict[int, PromptScores]]]:
        """The prefill of the starting requests together; if it fails, each alone finds the ones that
        fail (they fail, alone) and the rest are prefilled together. A failure of the rest is the batch's."""
        def together(items: list) -> tuple[Batch, dict[int, PromptScores]]:
            score = {i: r.config.top_logprobs for i, (_, r, *_) in enumerate(items) if r.config.prompt_logprobs}
            return scored_prefill(self.net, [r.prompt for _, r, *_ in items], extra, score, self.kv_cache_dtype,
                                  keep_hidden=self.draft_tokens > 0)

        try:
            return starts, together(starts)
        except Exception as exc:  # noqa: BLE001 - find the request that failed it
            if len(starts) == 1:
                self.fail(starts[0][0], exc)
                return [], (None, {})
        good = []
        for item in starts:
            try:
                scored_prefill(self.net, [item[1].prompt], 0, kv_cache_dtype=self.kv_cache_dtype)
                good.append(item)
            except Exception as exc:  # noqa: BLE001
                self.fail(item[0], exc)
        return (good, together(good)) if good else ([], (None, {}))

    def choose_tokens(self) -> torch.Tensor:
        """Each row's next token from its logits, recorded with its log-probability; marks finished rows."""
        rows, logits, settings = self.rows, self.batch.logits, self.settings
        sampled_from = logits
        if settings.penalty is not None:
            unseen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            seen = torch.stack([unseen if r.seen is None else r.seen for r in rows])
            sampled_from = repetition_penalty(logits.float(), seen, settings.penalty)
        if settings.greedy:
            tokens = sampled_from.argmax(dim=-1)
        else:
            tokens = sample_next_token(sampled_from, settings.temperature, settings.top_k, settings.top_p,
                                       [r.generator for r in rows], settings.min_p)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        k = settings.top_logprobs
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        for i, (row, token) in enumerate(zip(rows, tokens.tolist())):
            if row.request in self.cancelled:  # another sample of its request failed this step
                continue
            try:
                self.record(row, token, chosen[i], (top_ids[i], top_values[i]) if k else None)
            except Exception as exc:  # noqa: BLE001 - its callback or stop strings: the request fails alone
                self.fail(row.request, exc)
        return tokens

    def record(self, row: Row, token: int, logprob: float, top: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Append the token to the row, or finish the row at a stop token, stop string or its length."""
        cfg = row.config
        alternatives = None
        if cfg.top_logprobs:
            alternatives = list(zip(top[0][: cfg.top_logprobs].tolist(), top[1][: cfg.top_logprobs].tolist()))
        if token in row.stop_ids:
            row.finish, row.stop_token = "stop", (token, logprob, alternatives)
            return
        row.tokens.append(token)
        row.logprobs.append(logprob)
        if row.seen is not None:
            row.seen[token] = True
        if row.top_logprobs is not None:
            row.top_logprobs.append(alternatives)
        if cfg.stop:
            # Look for a stop string in the last few tokens only (a token is at least one byte,
            # a character at most four), then cut the whole text at the first one.
            tail = 4 * max(len(s) for s in cfg.stop) + 4
            if find_stop(self.tokenizer.decode(row.tokens[-tail:]), cfg.stop) >= 0:
                text = self.tokenizer.decode(row.tokens)
                cut = find_stop(text, cfg.stop)
                if cut >= 0:
                    row.text, row.finish = text[:cut], "stop"
                    return
        if row.on_token is not None:
            row.on_token(row.sample, token, logprob, alternatives)
        if len(row.tokens) >= cfg.max_new_tokens:
            row.finish = "length"

    def collect(self, finished: list[Row]) -> list[tuple[int, list[Generation]]]:
        """The requests whose every sample has now finished."""
        out = []
        for row in finished:
            samples = self.done.setdefault(row.request, [])
            samples.append(row)
            if len(samples) == row.config.n:
                del self.done[row.request]
                out.append((row.request, [self.generation(r) for r in sorted(samples, key=lambda r: r.sample)]))
        return out

    def generation(self, row: Row) -> Generation:
        text = row.text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(row.tokens)
        prompt_logprobs, prompt_top = row.prompt_scores if row.prompt_scores is not None else (None, None)
        return Generation(row.prompt, row.tokens, row.finish, text, row.logprobs, row.top_logprobs, row.stop_token,
                          prompt_logprobs, prompt_top)


def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig,
    tokenizer: Tokenizer | None = None,
    max_batch: int = 64,
    kv_cache_dtype: str = "auto",
    draft_tokens: int = 0,
) -> list[Generation]:
    """Continue each prompt (token ids) until a stop token, a stop string or ``max_new_tokens``;
    ``config.n`` generations per prompt, prompt after prompt. With ``config.seed`` the prompts
    share one generator, as one seeded call. ``kv_cache_dtype``: how the KV cache is stored
    (``kv_cache.KV_CACHE_DTYPES``). ``draft_tokens`` > 0: greedy decoding one prompt at a time,
    drafting that many tokens a step with the model's MTP modules (``speculative``): the same tokens."""
    if not prompts:
        raise ValueError("every prompt needs at least one token (add a BOS token to an empty prompt)")
    engine = Engine(model, tokenizer, max_batch=1 if draft_tokens else max_batch, kv_cache_dtype=kv_cache_dtype,
                    draft_tokens=draft_tokens)
    generator = None
    if config.seed is not None:
        generator = torch.Generator(model.embed.weight.device).manual_seed(config.seed)
    ids = [engine.submit(Request(p, config, generator)) for p in prompts]
    results = dict(engine.run())
    if draft_tokens:
        proposed, accepted = engine.draft_stats
        logging.getLogger("lmforge").info("generate: %d tokens drafted by the MTP modules, %d accepted (%.1f%%)",
                                          proposed, accepted, 100 * accepted / max(proposed, 1))
    return [g for i in ids for g in results[i]]

