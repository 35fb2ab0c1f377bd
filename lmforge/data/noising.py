"""What the encoder and prefix objectives feed the model: BERT's masking, T5's span corruption
and the prefix-LM split of a token window.

Each ``Noise`` turns one window of ``seq_len + 1`` tokens (a ``TokenLoader`` row) into a row of
``seq_len`` positions:

- ``input_ids``: what the model reads;
- ``labels``: at each position, the token the loss asks for there (-100: none);
- ``prefix_len``: positions before it attend to each other both ways, later ones causally
  (``objectives.denoising.prefix_lm_mask``); masked LM's prefix is the whole row.

lmforge's model is a decoder-only transformer, so span corruption is laid out as decoder-only
models train it (UL2, Tay et al. 2022; PaLM's and UL2's "prefix LM" denoisers): the corrupted
input and its targets in one row, ``[inputs ; targets]``, the inputs as a bidirectional prefix
and the loss on the targets, rather than T5's separate encoder and decoder.

A row's random draws come from a generator keyed by the loader's seed, its sample counter after
the batch and the row's index in the global batch (``row_generator``): the corruption is a
function of the loader's state, so a resumed run sees exactly the masks an uninterrupted one
would, whatever the number of data-parallel ranks, and each evaluation draws the same masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from lmforge.core.config import at_least, unit_interval
from lmforge.core.io import InputError
from lmforge.data.loader import TokenLoader
from lmforge.data.packing import IGNORE_INDEX
from lmforge.data.tokenizer import Tokenizer

NOISE_SALT = 0x6E6F697365  # keeps the masks' stream apart from every other use of the loader's seed


@dataclass
class MaskingConfig:
    """BERT's masking (``objective: mlm``), with the keys of transformers' ``DataCollatorForLanguageModeling``."""

    mlm_probability: float = unit_interval(
        0.15, low_open=True, help="share of the tokens selected for prediction (BERT: 15%); special tokens never are"
    )
    mask_replace_prob: float = unit_interval(0.8, help="of the selected tokens, the share replaced by the mask token")
    random_replace_prob: float = unit_interval(
        0.1, help="of the selected tokens, the share replaced by a random ordinary token (the rest are kept)"
    )

    def __post_init__(self) -> None:
        if self.mask_replace_prob + self.random_replace_prob > 1:
            raise ValueError(f"mask_replace_prob + random_replace_prob = {self.mask_replace_prob} + "
                             f"{self.random_replace_prob} exceeds 1: they are shares of the same selected tokens")


@dataclass
class SpanConfig:
    """T5's span corruption (``objective: span``)."""

    noise_density: float = unit_interval(
        0.15, low_open=True, high_open=True, help="share of each window's tokens dropped in spans (T5: 0.15)"
    )
    mean_span_length: float = at_least(1, 3.0, help="mean length of a dropped span, in tokens (T5: 3)")


Row = tuple[np.ndarray, np.ndarray, int]  # input_ids, labels, prefix_len


class Noise(Protocol):
    def __call__(self, window: np.ndarray, rng: np.random.Generator) -> Row:
        """One row (``input_ids``, ``labels``, ``prefix_len``) of ``seq_len`` positions from a window of ``seq_len + 1``."""


class BertMasking:
    """BERT's masked-LM input (Devlin et al. 2019, §3.1), drawn as transformers' collator draws it:
    each ordinary token is selected with probability ``mlm_probability``; a selected one becomes
    the mask token with probability ``mask_replace_prob``, a random ordinary token with
    ``random_replace_prob``, and stays itself otherwise; the labels are the selected tokens."""

    def __init__(self, cfg: MaskingConfig, mask_id: int, special_ids: list[int], vocab_size: int):
        self.cfg, self.mask_id = cfg, mask_id
        self.is_special = np.zeros(vocab_size, dtype=bool)
        self.is_special[special_ids] = True
        self.ordinary = np.flatnonzero(~self.is_special)

    def __call__(self, window: np.ndarray, rng: np.random.Generator) -> Row:
        tokens = window[:-1]
        n = len(tokens)
        selected = (rng.random(n) < self.cfg.mlm_probability) & ~self.is_special[tokens]
        how = rng.random(n)
        masked = selected & (how < self.cfg.mask_replace_prob)
        randomized = selected & ~masked & (how < self.cfg.mask_replace_prob + self.cfg.random_replace_prob)
        inputs = tokens.copy()
        inputs[masked] = self.mask_id
        inputs[randomized] = self.ordinary[rng.integers(0, len(self.ordinary), int(randomized.sum()))]
        return inputs, np.where(selected, tokens, IGNORE_INDEX), n


def noise_span_counts(length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of ``random_spans_noise_mask`` over ``length`` tokens: fixed by the length."""
    length = max(length, 2)
    noise = min(max(round(length * noise_density), 1), length - 1)
    return noise, max(round(noise / mean_span_length), 1)


def random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths of ``num_segments`` non-empty segments of ``num_items`` items, uniformly at random
    (T5's ``_random_segmentation``: a shuffled choice of the segments' first items)."""
    first_in_segment = np.arange(num_items - 1) < num_segments - 1
    rng.shuffle(first_in_segment)
    segment_id = np.cumsum(np.concatenate([[False], first_in_segment]))
    return np.bincount(segment_id, minlength=num_segments)


def random_spans_noise_mask(length: int, noise_density: float, mean_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
    """T5's ``random_spans_noise_mask`` (Raffel et al. 2020, ``t5.data.preprocessors``): a boolean
    mask of ``round(length * noise_density)`` noise tokens in ``round(noise / mean_span_length)``
    spans of random lengths, interleaved with as many non-noise spans; the row starts with a
    non-noise span and ends with a noise span."""
    noise, spans = noise_span_counts(length, noise_density, mean_span_length)
    padded = max(length, 2)
    noise_lengths = random_segmentation(noise, spans, rng)
    nonnoise_lengths = random_segmentation(padded - noise, spans, rng)
    interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)
    span_start = np.zeros(padded, dtype=np.int64)
    span_start[np.cumsum(interleaved)[:-1]] = 1
    return (np.cumsum(span_start) % 2 == 1)[:length]


def noise_span_to_unique_sentinel(tokens: np.ndarray, noise: np.ndarray, sentinels: np.ndarray) -> np.ndarray:
    """``tokens`` with each span of ``noise`` replaced by one sentinel, the i-th span by ``sentinels[i]``
    (T5's ``noise_span_to_unique_sentinel``, its ``<extra_id_i>`` counted from the first span)."""
    first = noise & ~np.concatenate([[False], noise[:-1]])
    out = np.where(first, sentinels[np.maximum(np.cumsum(first) - 1, 0)], tokens)
    return out[~noise | first]


def span_raw_length(row_len: int, noise_density: float, mean_span_length: float) -> int:
    """The most tokens of a window whose corrupted inputs and targets, laid end to end (each span
    adds a sentinel to both), fit in ``row_len``: T5's ``compute_input_and_target_lengths`` for one row."""
    for n in range(row_len, 1, -1):
        if n + 2 * noise_span_counts(n, noise_density, mean_span_length)[1] <= row_len:
            return n
    raise InputError(f"span corruption: a window of {row_len} tokens is too short to hold any span and its sentinels: "
                     "raise data.seq_len")


class SpanCorruption:
    """T5's span corruption laid out for a decoder-only model (UL2): a row is the corrupted
    input (each dropped span replaced by its sentinel) then the targets (the sentinels, each
    followed by its span), padded to ``seq_len + 1``; the inputs are the bidirectional prefix and
    the loss falls on the targets, each predicted from the position before it."""

    def __init__(self, cfg: SpanConfig, sentinel_ids: list[int], pad_id: int, seq_len: int):
        self.cfg, self.pad_id, self.row_len = cfg, pad_id, seq_len + 1
        self.raw_len = span_raw_length(self.row_len, cfg.noise_density, cfg.mean_span_length)
        noise, self.spans = noise_span_counts(self.raw_len, cfg.noise_density, cfg.mean_span_length)
        if self.spans > self.raw_len - noise:
            raise InputError(f"span.noise_density {cfg.noise_density} leaves {self.raw_len - noise} kept tokens of "
                             f"{self.raw_len} for {self.spans} spans, which need a kept token before each: lower "
                             "span.noise_density or raise span.mean_span_length")
        if self.spans > len(sentinel_ids):
            raise InputError(f"objective=span: windows of data.seq_len={seq_len} tokens are cut into {self.spans} spans, "
                             f"but the tokenizer has {len(sentinel_ids)} sentinel tokens (<extra_id_0>...): train one "
                             f"with tokenizer.sentinel_tokens={max(100, self.spans)} and prepare the data with it")
        self.sentinels = np.asarray(sentinel_ids[: self.spans], dtype=np.int64)

    def __call__(self, window: np.ndarray, rng: np.random.Generator) -> Row:
        tokens = window[: self.raw_len]
        noise = random_spans_noise_mask(self.raw_len, self.cfg.noise_density, self.cfg.mean_span_length, rng)
        inputs = noise_span_to_unique_sentinel(tokens, noise, self.sentinels)
        targets = noise_span_to_unique_sentinel(tokens, ~noise, self.sentinels)
        row = np.full(self.row_len, self.pad_id, dtype=np.int64)
        a, b = len(inputs), len(targets)
        row[:a], row[a : a + b] = inputs, targets
        labels = np.full(self.row_len - 1, IGNORE_INDEX, dtype=np.int64)
        labels[a - 1 : a + b - 1] = targets  # position t predicts row[t + 1]
        return row[:-1], labels, a


class PrefixSplit:
    """The prefix LM (Raffel et al. 2020, §3.2.1; Dong et al. 2019): a window cut at a uniformly
    random point P in 1..seq_len; the first P tokens are a bidirectional prefix, the rest is
    predicted causally, each token from the position before it (the prefix's last one predicts
    the first token after it)."""

    def __call__(self, window: np.ndarray, rng: np.random.Generator) -> Row:
        n = len(window) - 1
        prefix = int(rng.integers(1, n + 1))
        labels = window[1:].copy()
        labels[: prefix - 1] = IGNORE_INDEX
        return window[:-1], labels, prefix


def row_generator(seed: int, samples: int, row: int) -> np.random.Generator:
    """The generator of global row ``row`` of the batch after which the loader had served ``samples``."""
    return np.random.default_rng([NOISE_SALT, seed, samples, row])


def noise_batch(windows: torch.Tensor, noise: Noise, seed: int, samples: int, first_row: int) -> dict[str, torch.Tensor]:
    """The rows of ``windows`` (B, seq_len + 1), the first being global row ``first_row``, as a batch
    of ``input_ids``, ``labels`` (B, seq_len) and ``prefix_len`` (B,)."""
    arrays = windows.numpy()
    rows = [noise(w, row_generator(seed, samples, first_row + i)) for i, w in enumerate(arrays)]
    T = windows.shape[1] - 1
    return {
        "input_ids": torch.from_numpy(np.stack([r[0] for r in rows]).astype(np.int64)) if rows else torch.zeros(0, T, dtype=torch.long),
        "labels": torch.from_numpy(np.stack([r[1] for r in rows]).astype(np.int64)) if rows else torch.zeros(0, T, dtype=torch.long),
        "prefix_len": torch.tensor([r[2] for r in rows], dtype=torch.long),
    }


class NoisedLoader:
    """A ``TokenLoader`` whose windows come out corrupted by ``noise``; its state is the loader's."""

    def __init__(self, loader: TokenLoader, noise: Noise):
        self.loader, self.noise = loader, noise

    def __iter__(self) -> NoisedLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        windows = next(self.loader)
        return noise_batch(windows, self.noise, self.loader.cfg.seed, self.loader.samples,
                           self.loader.rank * self.loader.batch_size)

    def restart(self) -> NoisedLoader:
        self.loader.restart()
        return self

    # what the loop, the checkpointer and a loss-spike rollback read of a training loader
    @property
    def cfg(self):
        return self.loader.cfg

    @property
    def samples(self) -> int:
        return self.loader.samples

    @property
    def batch_size(self) -> int:
        return self.loader.batch_size

    @property
    def world_size(self) -> int:
        return self.loader.world_size

    def skip_samples(self, start: int, stop: int) -> None:
        self.loader.skip_samples(start, stop)

    def pop_metrics(self) -> dict[str, float]:
        """The loader's: what the step's windows were drawn from (a mixture's shares, the order's scores)."""
        return self.loader.pop_metrics()

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


def build_noise(objective: str, mlm: MaskingConfig, span: SpanConfig, tok: Tokenizer, seq_len: int,
                tokenizer_dir: str) -> Noise | None:
    """The corruption of pre-training ``objective`` (None: causal LM), checked against the
    tokenizer: masked LM needs its mask token, span corruption enough sentinels."""
    if objective == "mlm":
        if tok.mask_id is None:
            raise InputError(f"objective=mlm: the tokenizer at {tokenizer_dir} has no mask token (mask_token in its "
                             "tokenizer_config.json): train one with tokenizer.mask_token='[MASK]' "
                             "(lmforge tokenizer) and prepare the data with it")
        return BertMasking(mlm, tok.mask_id, tok.special_ids, tok.vocab_size)
    if objective == "span":
        return SpanCorruption(span, tok.sentinel_ids, tok.pad_id, seq_len)
    if objective == "prefix_lm":
        return PrefixSplit()
    return None
