"""The three requests of lm-evaluation-harness on an lmforge model, batched: log-likelihood of a
continuation, rolling log-likelihood of a whole text, and generation until a stop string.
``lmforge eval`` and the harness adapter (``eval.harness``) both call these, so their numbers agree.

The encodings follow the harness's (``TemplateLM``, ``HFLM``): every scored sequence starts with
the tokenizer's BOS, as documents did in pre-training (the harness's ``prefix_token_id``).

- ``encode_pair``: trailing spaces of the context move to the continuation; the continuation's
  tokens are those of ``encode(context + continuation)`` past ``encode(context)``; an empty
  context is BOS alone.
- ``loglikelihood``: one forward over ``(context + continuation)[-(L + 1):][:-1]`` (left-truncated
  to the model's ``max_seq_len`` L), right-padded in batches sorted longest first; the sum of the
  continuation's log-softmax (float32) and whether greedy decoding would give it.
- ``loglikelihood_rolling``: the harness's disjoint rolling windows (``rolling_windows``) over
  ``encode(text)`` with BOS as the first context, each window scored as above; every token is
  predicted once, each window with the longest context that fits.
- ``generate_until``: the engine (``inference.engine``), greedy or sampled, stopping at
  end of text, ``until`` or ``max_gen_toks``; the context is left-truncated to L - max_gen_toks
  and the text cut at each stop string in turn (the harness's ``postprocess_generated_text``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from lmforge.checkpoints.device import resolve_device
from lmforge.checkpoints.load import load_model
from lmforge.core.run import progress_bar
from lmforge.data.tokenizer import Tokenizer
from lmforge.inference.engine import Engine, GenerationConfig, Request

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

DEFAULT_MAX_GEN_TOKS = 256
MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # first one set wins
GENERATION_KEYS = {"until", *MAX_TOKEN_KEYS, "do_sample", "temperature", "top_p", "top_k"}


def load_checkpoint(path: str, device: str = "auto", dtype: str = "float32",
                    verify: bool = True) -> tuple[nn.Module, Tokenizer]:
    """The model of a checkpoint (or a run's newest valid one), in eval mode, and its tokenizer
    (``verify``: check the checksums; off for a checkpoint directory already checked)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model, directory = load_model(path, device=resolve_device(device), verify=verify)
    return model.to(DTYPES[dtype]).eval(), Tokenizer.load(directory)


def encode_pair(tok: Tokenizer, context: str, continuation: str, bos: bool = True) -> tuple[list[int], list[int]]:
    """(context ids, with BOS first unless ``bos`` is false, continuation ids), split as the
    harness splits them (an empty context is BOS alone either way: its ``prefix_token_id``)."""
    if context == "":
        cont = tok.encode(continuation)
        if cont and cont[0] == tok.bos_id:
            return cont[:1], cont[1:]
        return [tok.bos_id], cont
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok.encode(context + continuation)
    ctx = tok.encode(context)
    return ([tok.bos_id] if bos else []) + ctx, whole[len(ctx):]


def batches(order: list[int], size: int) -> Iterator[list[int]]:
    for i in range(0, len(order), size):
        yield order[i : i + size]


@torch.inference_mode()
def loglikelihood(model: nn.Module, requests: Sequence[tuple[list[int], list[int]]], batch_size: int = 16,
                  desc: str = "loglikelihood") -> list[tuple[float, bool]]:
    """(log p(continuation | context), is greedy) of each (context ids, continuation ids)."""
    max_len = model.cfg.max_seq_len
    for ctx, cont in requests:
        if not ctx or not cont:
            raise ValueError("a log-likelihood request needs a non-empty context and continuation")
        if len(cont) > max_len:
            raise ValueError(f"a continuation of {len(cont)} tokens is longer than the model's max_seq_len {max_len}")
    device = model.embed.weight.device
    order = sorted(range(len(requests)), key=lambda i: (-len(requests[i][0]) - len(requests[i][1]),
                                                        tuple(requests[i][0] + requests[i][1])))
    out: list[tuple[float, bool] | None] = [None] * len(requests)
    bar = progress_bar(len(requests), desc)
    for chunk in batches(order, batch_size):
        inputs = [(requests[i][0] + requests[i][1])[-(max_len + 1):][:-1] for i in chunk]
        width = max(len(x) for x in inputs)
        tokens = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, x in enumerate(inputs):
            tokens[row, : len(x)] = torch.tensor(x)
        logits = model(tokens.to(device))  # right padding: causal attention keeps it out of the real positions
        for row, i in enumerate(chunk):
            cont = requests[i][1]
            n = len(inputs[row])
            scores = torch.log_softmax(logits[row, n - len(cont) : n].float(), dim=-1)
            target = torch.tensor(cont, device=scores.device)
            greedy = bool((scores.argmax(dim=-1) == target).all())
            out[i] = (float(scores.gather(1, target[:, None]).sum()), greedy)
        bar.update(len(chunk))
    bar.close()
    return out  # type: ignore[return-value]


def loglikelihood_pairs(model: nn.Module, tok: Tokenizer, pairs: Sequence[tuple[str, str]],
                        batch_size: int = 16, bos: bool = True) -> list[tuple[float, bool]]:
    """``loglikelihood`` of (context, continuation) texts (``bos``: see ``encode_pair``)."""
    requests = [encode_pair(tok, ctx, cont, bos) for ctx, cont in pairs]
    for (ctx, cont), (_, ids) in zip(pairs, requests):
        if not ids:
            raise ValueError(f"the continuation {cont!r} of context {ctx[-40:]!r} encodes to no tokens")
    return loglikelihood(model, requests, batch_size)


def rolling_windows(tokens: list[int], prefix: int, max_seq_len: int,
                    context_len: int = 1) -> Iterator[tuple[list[int], list[int]]]:
    """The harness's ``get_rolling_token_windows``: (input, predicted) windows that predict every
    token once, the first from ``prefix``, each later one with the longest context that fits."""
    if not 1 <= context_len <= max_seq_len:
        raise ValueError(f"need 1 <= context_len <= max_seq_len, got {context_len} and {max_seq_len}")
    if not tokens:
        return
    pred_len = max_seq_len - context_len + 1
    first = min(max_seq_len, len(tokens))
    yield [prefix, *tokens[: first - 1]], tokens[:first]
    predicted = first
    while predicted < len(tokens):
        n = min(len(tokens) - predicted, pred_len)
        end = predicted + n
        yield tokens[end - max_seq_len - 1 : end - 1], tokens[end - n : end]
        predicted += n


def disjoint_window(window: tuple[list[int], list[int]]) -> tuple[list[int], list[int]]:
    """The harness's ``make_disjoint_window``: the context without the tokens it predicts."""
    a, b = window
    return a[: len(a) - (len(b) - 1)], b


def loglikelihood_rolling(model: nn.Module, tok: Tokenizer, texts: Sequence[str], batch_size: int = 16) -> list[float]:
    """log p(text) of each whole text, over the harness's disjoint rolling windows."""
    windows, owner = [], []
    for i, text in enumerate(texts):
        for w in rolling_windows(tok.encode(text), tok.bos_id, model.cfg.max_seq_len):
            windows.append(disjoint_window(w))
            owner.append(i)
    totals = [0.0] * len(texts)
    for i, (ll, _) in zip(owner, loglikelihood(model, windows, batch_size, desc="loglikelihood_rolling")):
        totals[i] += ll
    return totals


def check_generation_kwargs(kwargs: object) -> None:
    """``ValueError`` naming the key for generation kwargs of a wrong type or range, which would
    otherwise fail deep in the engine or, for a negative temperature, decode greedily unasked."""
    if not isinstance(kwargs, dict):
        raise ValueError(f"generation_kwargs must be a mapping of options (until, max_gen_toks, ...), got {kwargs!r}")
    unknown = set(kwargs) - GENERATION_KEYS
    if unknown:
        raise ValueError(f"generation_kwargs {sorted(map(str, unknown))} are not supported "
                         f"(supported: {sorted(GENERATION_KEYS)})")

    def number(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    def integer(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    until = kwargs.get("until")
    if not (until is None or isinstance(until, str) or isinstance(until, (list, tuple)) and all(isinstance(u, str) for u in until)):
        raise ValueError(f"generation_kwargs.until must be a stop string or a list of stop strings, got {until!r}")
    rules = {
        **{key: (lambda v: integer(v) and v >= 1, "an integer >= 1") for key in MAX_TOKEN_KEYS},
        "temperature": (lambda v: number(v) and v >= 0, "a number >= 0 (0 decodes greedily)"),
        "top_p": (lambda v: number(v) and 0 < v <= 1, "a number in (0, 1] (1 = off)"),
        "top_k": (lambda v: integer(v) and v >= 0, "an integer >= 0 (0 = off)"),
        "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    }
    for key, (valid, what) in rules.items():
        value = kwargs.get(key)
        if value is not None and not valid(value):
            raise ValueError(f"generation_kwargs.{key} must be {what}, got {value!r}")


def generation_config(kwargs: dict, eos_text: str, default_max: int = DEFAULT_MAX_GEN_TOKS) -> tuple[GenerationConfig, list[str]]:
    """The harness's ``normalize_gen_kwargs`` + ``handle_stop_sequences``: the engine's config and the stop strings."""
    check_generation_kwargs(kwargs)
    until = kwargs.get("until")
    until = [] if until is None else [until] if isinstance(until, str) else list(until)
    if eos_text not in until:
        until.append(eos_text)
    max_gen = next((kwargs[k] for k in MAX_TOKEN_KEYS if kwargs.get(k) is not None), default_max)
    temperature = float(kwargs.get("temperature", 0.0))
    do_sample = kwargs.get("do_sample")
    sample = temperature > 0.0 if do_sample is None else bool(do_sample) and temperature > 0.0
    config = GenerationConfig(max_new_tokens=int(max_gen), temperature=temperature if sample else 0.0,
                              top_p=float(kwargs.get("top_p", 1.0)), top_k=int(kwargs.get("top_k", 0)),
                              stop=[u for u in until if u])
    return config, until


def request_seed(seed: int, context: str, kwargs: dict, occurrence: int) -> int:
    """A sampled request's own seed: the same request draws the same tokens whatever else is in the
    batch and in whatever order the requests come (the k-th copy of a request, its k-th draw)."""
    key = json.dumps([seed, context, kwargs, occurrence], sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """The harness's cut: the text before each stop string, one after another."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


@torch.inference_mode()
def generate_until(model: nn.Module, tok: Tokenizer, requests: Sequence[tuple[str, dict]], seed: int = 1234,
                   batch_size: int = 16, bos: bool = True) -> list[str]:
    """The continuation of each (context, generation kwargs), cut at its stop strings; the
    prompt starts with BOS unless ``bos`` is false."""
    max_len = model.cfg.max_seq_len
    engine = Engine(model, tok, max_batch=batch_size)
    eos_text = tok.decode([tok.eos_id])
    device = model.embed.weight.device
    seen: dict[str, int] = {}
    stops_of: dict[int, list[str]] = {}
    ids = []
    for context, kwargs in requests:
        config, stops = generation_config(kwargs, eos_text)
        room = max_len - config.max_new_tokens
        if room <= 0:
            raise ValueError(f"max_gen_toks {config.max_new_tokens} leaves no room for a context in the model's "
                             f"max_seq_len {max_len}")
        prompt = (([tok.bos_id] if bos else []) + tok.encode(context))[-room:]
        key = json.dumps([context, kwargs], sort_keys=True, default=str)
        occurrence = seen[key] = seen.get(key, -1) + 1
        generator = None
        if config.temperature > 0:
            generator = torch.Generator(device).manual_seed(request_seed(seed, context, kwargs, occurrence))
        request_id = engine.submit(Request(prompt, config, generator))
        stops_of[request_id] = stops
        ids.append(request_id)
    texts: dict[int, str] = {}
    bar = progress_bar(len(ids), "generate_until")
    for request_id, (generation,) in engine.run():
        texts[request_id] = cut_at_stops(tok.decode(generation.tokens), stops_of[request_id])
        bar.update(1)
    bar.close()
    return [texts[i] for i in ids]
