"""Byte-level BPE tokenizer: training with the ``tokenizers`` library, saving in HF's format.

The pre-tokenizer is the GPT-4 / Llama-3 split pattern (digits in groups of at most
three, contractions, punctuation runs) followed by byte-level mapping, so every string
round-trips exactly; ``digit_group: 1`` splits every digit apart instead (Llama 1/2, PaLM),
which a small model needs to copy and do arithmetic on numbers. Special tokens take the first
ids: beginning and end of text, padding (never the same id as end-of-turn), the ChatML
turn markers, the extra ones, then, when asked for, the masked-LM mask token (BERT's ``[MASK]``)
and T5's sentinels ``<extra_id_0>``, ``<extra_id_1>``... that span corruption puts in place of
each dropped span.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from lmforge.core.config import at_least, option, positive
from lmforge.core.io import InputError, atomic_write_bytes, atomic_write_json, read_json


def split_pattern(digit_group: int = 3) -> str:
    """Llama-3's pre-tokenization pattern (itself GPT-4's cl100k pattern), with numbers cut
    into runs of at most ``digit_group`` digits (3 in Llama 3)."""
    return (
        rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,{digit_group}}}|"
        r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )


TOKENIZER_FILE = "tokenizer.json"
SENTINEL = "<extra_id_{}>"  # T5's name of the i-th span-corruption sentinel
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@dataclass
class TokenizerConfig:
    """What BPE vocabulary to learn and which special tokens to reserve."""

    vocab_size: int = at_least(
        256, 8192, help="tokens in the vocabulary: the 256 bytes, the merges and the special tokens"
    )
    min_frequency: int = at_least(0, 2, help="a pair must occur this often to be merged")
    bos_token: str = option("<|begin_of_text|>", help="the special token that begins each document")
    eos_token: str = option("<|end_of_text|>", help="the special token that ends each document")
    pad_token: str = option("<|pad|>", help="the special token that pads a batch's shorter rows")
    chat_tokens: list[str] = option(
        default_factory=lambda: ["<|im_start|>", "<|im_end|>"], help="the special tokens of the ChatML chat template"
    )
    extra_special_tokens: list[str] = option(
        default_factory=list, help="more special tokens to reserve: never split, never merged"
    )
    mask_token: str | None = option(
        None, help="a special token for masked-LM pre-training (pretrain objective=mlm), e.g. [MASK]; None: none"
    )
    sentinel_tokens: int = at_least(
        0, 0, help="T5's span-corruption sentinels <extra_id_0> ... to add (pretrain objective=span; T5 has 100)"
    )
    model_max_length: int = positive(2048, help="recorded in tokenizer_config.json for HF users")
    max_train_chars: int | None = positive(None, help="cap on training text, None = use all of it")
    digit_group: int = at_least(
        1,
        3,
        help="numbers are cut into pre-tokens of at most this many digits before BPE: 3 as in GPT-4 and Llama 3; "
        '1 gives every digit its own token (Llama 1/2, PaLM), so that "4600" begins with the tokens of "46": '
        "what a small model needs to copy numbers and add them",
    )

    def __post_init__(self) -> None:
        specials = self.special_tokens
        if len(set(specials)) != len(specials):
            raise ValueError(f"special tokens must be distinct, got {specials}")
        if self.vocab_size < 256 + len(specials):
            raise ValueError(f"vocab_size must be at least {256 + len(specials)} (256 bytes + special tokens)")

    @property
    def special_tokens(self) -> list[str]:
        return [self.bos_token, self.eos_token, self.pad_token, *self.chat_tokens, *self.extra_special_tokens,
                *self.denoising_tokens]

    @property
    def denoising_tokens(self) -> list[str]:
        """The mask token and the sentinels, last among the special tokens (none by default)."""
        mask = [self.mask_token] if self.mask_token is not None else []
        return mask + [SENTINEL.format(i) for i in range(self.sentinel_tokens)]


class Tokenizer:
    """A trained tokenizer: ``encode``/``decode`` without hidden special-token handling."""

    def __init__(self, hf: HFTokenizer, config: dict, source: str | Path = "tokenizer_config.json"):
        self.hf = hf
        self.config = config
        self.bos_id, self.eos_id, self.pad_id = (self.special_id(config, key, source)
                                                 for key in ("bos_token", "eos_token", "pad_token"))

    @property
    def mask_id(self) -> int | None:
        """The id of ``tokenizer_config.json``'s ``mask_token`` (masked-LM pre-training); None without one."""
        token = self.config.get("mask_token")
        if isinstance(token, dict):
            token = token.get("content")
        return self.hf.token_to_id(token) if isinstance(token, str) and token else None

    @property
    def sentinel_ids(self) -> list[int]:
        """The ids of T5's sentinels ``<extra_id_0>``, ``<extra_id_1>``... in the vocabulary, in order:
        what span corruption puts in place of the first, second... dropped span."""
        ids: list[int] = []
        while (idx := self.hf.token_to_id(SENTINEL.format(len(ids)))) is not None:
            ids.append(idx)
        return ids

    @property
    def special_ids(self) -> list[int]:
        """Every added special token's id (BOS, EOS, pad, chat markers, mask, sentinels...)."""
        return sorted(i for i, t in self.hf.get_added_tokens_decoder().items() if t.special)

    def special_id(self, config: dict, key: str, source: str | Path) -> int:
        """The id of the special token ``config[key]``: a string, or the ``{"content": ...}`` mapping
        older transformers write (Llama 2's ``AddedToken``); a missing one is an ``InputError``
        naming the file and key (Qwen's ``"bos_token": null``: lmforge begins every document with one)."""
        token = config.get(key)
        if isinstance(token, dict) and isinstance(token.get("content"), str):
            token = token["content"]
        if not isinstance(token, str) or not token:
            raise InputError(f"{source}: {key} is {token!r}; lmforge needs a BOS, an EOS and a pad token: set "
                             f'"{key}" to a special token of the vocabulary (for example "<|endoftext|>")')
        if self.hf.token_to_id(token) is None:
            raise InputError(f"{source}: {key} {token!r} is not in the vocabulary of tokenizer.json")
        return self.hf.token_to_id(token)

    # -- loading and saving
    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        directory = Path(directory)
        tok_file, cfg_file = directory / TOKENIZER_FILE, directory / TOKENIZER_CONFIG_FILE
        for f in (tok_file, cfg_file):
            if not f.is_file():
                raise InputError(f"{f}: not found; train a tokenizer with `lmforge tokenizer <recipe>` first")
        try:
            hf = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:
            raise InputError(f"{tok_file}: not a valid tokenizer.json: {exc}") from exc
        config = read_json(cfg_file, "tokenizer config")
        if not isinstance(config, dict):
            raise InputError(f"{cfg_file}: not a JSON object of tokenizer settings")
        return cls(hf, config, cfg_file)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        atomic_write_bytes(directory / TOKENIZER_FILE, self.to_json().encode("utf-8"))
        atomic_write_json(directory / TOKENIZER_CONFIG_FILE, self.config)

    def to_json(self) -> str:
        return self.hf.to_str(pretty=True)

    @property
    def sha256(self) -> str:
        """Identity of the vocabulary and merges; token shards record it."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    # -- vocabulary
    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int:
        idx = self.hf.token_to_id(token)
        if idx is None:
            raise InputError(f"token {token!r} is not in the vocabulary")
        return idx

    # -- encoding
    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts in parallel (the Rust side uses all cores)."""
        return [e.ids for e in self.hf.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)


def build_untrained(cfg: TokenizerConfig) -> tuple[HFTokenizer, trainers.BpeTrainer]:
    """The empty byte-level BPE pipeline and its trainer."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_pattern(cfg.digit_group)), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=cfg.special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return hf, trainer


def hf_tokenizer_config(cfg: TokenizerConfig) -> dict:
    """``tokenizer_config.json`` so that ``transformers`` loads the tokenizer as-is."""
    mask = {"mask_token": cfg.mask_token} if cfg.mask_token is not None else {}
    sentinels = [SENTINEL.format(i) for i in range(cfg.sentinel_tokens)]
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": cfg.bos_token,
        "eos_token": cfg.eos_token,
        "pad_token": cfg.pad_token,
        **mask,
        "additional_special_tokens": [*cfg.chat_tokens, *cfg.extra_special_tokens, *sentinels],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.model_max_length,
    }


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig) -> Tokenizer:
    """Learn a byte-level BPE vocabulary of ``cfg.vocab_size`` tokens from ``texts``."""
    hf, trainer = build_untrained(cfg)
    hf.train_from_iterator(_capped(texts, cfg.max_train_chars), trainer=trainer)
    specials = [hf.token_to_id(t) for t in cfg.special_tokens]
    assert specials == list(range(len(specials))), "special tokens must take the first ids"
    return Tokenizer(hf, hf_tokenizer_config(cfg))


def _capped(texts: Iterable[str], limit: int | None) -> Iterator[str]:
    used = 0
    for text in texts:
        if limit is not None and used + len(text) > limit:
            if limit - used > 0:
                yield text[: limit - used]
            return
        used += len(text)
        yield text


def compression_stats(tok: Tokenizer, texts: Iterable[str], batch: int = 256) -> dict:
    """Bytes and characters per token of ``texts`` (higher means better compression)."""
    n_bytes = n_chars = n_tokens = n_docs = 0
    buf: list[str] = []

    def flush() -> None:
        nonlocal n_tokens
        n_tokens += sum(len(ids) for ids in tok.encode_batch(buf))
        buf.clear()

    for text in texts:
        n_docs += 1
        n_bytes += len(text.encode("utf-8"))
        n_chars += len(text)
        buf.append(text)
        if len(buf) >= batch:
            flush()
    if buf:
        flush()
    return {
        "documents": n_docs,
        "bytes": n_bytes,
        "tokens": n_tokens,
        "bytes_per_token": n_bytes / n_tokens if n_tokens else float("nan"),
        "chars_per_token": n_chars / n_tokens if n_tokens else float("nan"),
    }


def token_byte_lengths(tok: Tokenizer) -> list[int]:
    """UTF-8 bytes each token id stands for (0 for special tokens), for bits-per-byte.

    In a byte-level BPE every character of a vocabulary entry stands for exactly one byte.
    """
    lengths = [0] * tok.vocab_size
    special = {t.content for t in tok.hf.get_added_tokens_decoder().values()}
    for token, idx in tok.hf.get_vocab(with_added_tokens=True).items():
        lengths[idx] = 0 if token in special else len(token)
    return lengths
