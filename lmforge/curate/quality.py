"""Model-based quality scores: a hashed n-gram linear classifier and perplexity under an lmforge model.

Both are corpus steps so that a cut can be an absolute threshold or a percentile of this
run's scores: ``index_shard`` scores each shard's documents and saves the scores,
``resolve`` turns the threshold or percentile into a cut, ``apply_shard`` writes the
score to ``metadata["<name>_score"]`` and rejects the documents on the wrong side of it.

* ``ClassifierScore``: P(high quality | text) from logistic regression on word unigrams and
  bigrams hashed into 2^k buckets, the model family of fastText's and DCLM's quality
  filters (Joulin et al. 2017; Li et al. 2024). ``train_classifier`` fits it from
  labelled JSONL. Documents scoring below the cut are rejected.
* ``PerplexityScore``: perplexity (or bits per byte) of the document under a language
  model, CCNet's filter (Wenzek et al. 2020), with an lmforge checkpoint in place of
  KenLM: ``ppl = exp(−(1/N) Σ_t log p(x_t | x_<t))``, ``bpb = −Σ_t log2 p(x_t | x_<t) / bytes``.
  Documents scoring above the cut (unlike the model's training domain) are rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from lmforge.core.config import (
    ConfigError,
    at_least,
    check_ranges,
    in_range,
    option,
    positive,
    seed_field,
    unit_interval,
)
from lmforge.core.io import InputError, atomic_directory, atomic_write_json, atomic_write_npy, expand_paths, read_json
from lmforge.curate.base import PoolMap
from lmforge.curate.minhash import combine_ngrams, document_words, word_hashes
from lmforge.data.documents import Document

CLASSIFIER_WEIGHTS = "classifier.npz"
CLASSIFIER_CONFIG = "classifier.json"
CLASSIFIER_FORMAT = "lmforge-hashed-ngram-logistic-regression"


def _check_cut(where: str, threshold: float | None, percentile: float | None) -> None:
    if threshold is not None and percentile is not None:
        raise ValueError(f"{where}: set threshold or percentile, not both")


# --------------------------------------------------------------------------- hashed n-gram features


def text_features(text: str, hash_bits: int, ngrams: int, normalize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Bucket indices and L2-normalised counts of the text's word 1..``ngrams``-grams."""
    h = word_hashes(document_words(text, normalize))
    grams = [combine_ngrams(h, k) for k in range(1, ngrams + 1) if len(h) >= k]
    if not grams:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    buckets = (np.concatenate(grams) & np.uint64((1 << hash_bits) - 1)).astype(np.int64)
    index, counts = np.unique(buckets, return_counts=True)
    values = counts.astype(np.float32)
    return index, values / np.float32(np.sqrt(np.sum(values * values)))


def _feature_matrix(texts: list[str], hash_bits: int, ngrams: int, normalize: bool) -> tuple[np.ndarray, ...]:
    """Compressed sparse rows: (indptr, indices, values)."""
    feats = [text_features(t, hash_bits, ngrams, normalize) for t in texts]
    indptr = np.zeros(len(texts) + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(i) for i, _ in feats])
    indices = np.concatenate([i for i, _ in feats]) if feats else np.empty(0, np.int64)
    values = np.concatenate([v for _, v in feats]) if feats else np.empty(0, np.float32)
    return indptr, indices, values


def _logits(w: np.ndarray, bias: float, indptr: np.ndarray, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    rows = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    return np.bincount(rows, weights=w[indices] * values, minlength=len(indptr) - 1) + bias


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


@dataclass
class HashedNgramClassifier:
    """Logistic regression on hashed n-gram features: p = σ(w · x + b)."""

    weights: np.ndarray  # float32, 2^hash_bits
    bias: float
    hash_bits: int
    ngrams: int
    normalize: bool
    info: dict = field(default_factory=dict)  # training metrics, saved beside the weights

    def score(self, texts: list[str]) -> np.ndarray:
        """P(label = 1) for each text."""
        indptr, indices, values = _feature_matrix(texts, self.hash_bits, self.ngrams, self.normalize)
        return _sigmoid(_logits(self.weights, self.bias, indptr, indices, values))

    def save(self, directory: str | Path) -> None:
        """``classifier.npz`` (weights, bias) and ``classifier.json`` (features, metrics), atomically."""
        with atomic_directory(directory) as tmp:
            np.savez(tmp / CLASSIFIER_WEIGHTS, weights=self.weights.astype(np.float32), bias=np.float64(self.bias))
            atomic_write_json(tmp / CLASSIFIER_CONFIG, {
                "format": CLASSIFIER_FORMAT, "hash_bits": self.hash_bits, "ngrams": self.ngrams,
                "normalize": self.normalize, "word_hash": "xxh64", **self.info,
            })

    @classmethod
    def load(cls, directory: str | Path) -> HashedNgramClassifier:
        directory = Path(directory)
        meta = read_json(directory / CLASSIFIER_CONFIG, "quality classifier config")
        if meta.get("format") != CLASSIFIER_FORMAT:
            raise InputError(f"{directory / CLASSIFIER_CONFIG}: not an lmforge quality classifier "
                             f"(format {meta.get('format')!r}); train one with `lmforge curate train-classifier`")
        try:
            with np.load(directory / CLASSIFIER_WEIGHTS) as data:
                weights, bias = data["weights"], float(data["bias"])
        except (OSError, KeyError, ValueError) as exc:
            raise InputError(f"{directory / CLASSIFIER_WEIGHTS}: cannot read classifier weights: {exc}") from exc
        if weights.shape != (1 << meta["hash_bits"],):
            raise InputError(f"{directory / CLASSIFIER_WEIGHTS}: {weights.shape[0]} weights, expected 2^{meta['hash_bits']}")
        info = {k: v for k, v in meta.items() if k not in ("format", "hash_bits", "ngrams", "normalize", "word_hash")}
        return cls(weights, bias, meta["hash_bits"], meta["ngrams"], meta["normalize"], info)


# --------------------------------------------------------------------------- training


@dataclass
class TrainClassifierConfig:
    """Train a quality classifier from labelled JSONL: one {"text": ..., "label": 1 or 0} per line."""

    data: list[str] = option(
        default_factory=list, help="JSONL files or globs; label 1 (or true) = keep, 0 (or false) = drop"
    )
    output: str = option(
        "runs/quality-classifier", help="folder for classifier.npz and classifier.json (replaced atomically)"
    )
    text_field: str = option("text", help="JSON key of the text")
    label_field: str = option("label", help="JSON key of the 0/1 label")
    hash_bits: int = in_range(
        20, 8, 28, help="features are hashed into 2^hash_bits buckets, a float32 weight each (2^28: 1 GB)"
    )
    ngrams: int = positive(2, help="word n-grams up to this order (2 = unigrams and bigrams)")
    normalize: bool = option(
        True, help="datatrove's text normalisation before splitting words, as MinHash's normalize"
    )
    epochs: int = positive(5, help="passes over the training split")
    batch_size: int = positive(32, help="documents per Adagrad step")
    learning_rate: float = positive(0.5, help="Adagrad step size")
    l2: float = at_least(0, 1e-6, help="L2 penalty on the weights, (l2/2)·|w|² added to the mean log loss")
    validation_fraction: float = unit_interval(
        0.1, high_open=True, help="share of the examples held out, for the reported accuracy"
    )
    seed: int = seed_field(0, help="seeds the shuffling and the held-out split")

    def __post_init__(self) -> None:
        check_ranges(self, source="train-classifier")  # built in Python too


def read_labelled(cfg: TrainClassifierConfig) -> tuple[list[str], np.ndarray]:
    """Texts and 0/1 labels; a bad line is an ``InputError`` naming the file and line."""
    from lmforge.data.documents import BadRecord, jsonl_records

    texts: list[str] = []
    labels: list[int] = []
    for path in expand_paths(cfg.data, what="classifier training"):
        for where, record in jsonl_records(path):
            if isinstance(record, BadRecord):
                raise InputError(f"{where}: {record.detail}")
            if not isinstance(record, dict):
                raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
            text, label = record.get(cfg.text_field), record.get(cfg.label_field)
            if not isinstance(text, str):
                raise InputError(f"{where}: {cfg.text_field!r} must be a string, got {type(text).__name__}")
            if label not in (0, 1):  # True and False compare equal to 1 and 0
                raise InputError(f"{where}: {cfg.label_field!r} must be 1 or 0 (or true/false), got {label!r}")
            texts.append(text)
            labels.append(int(label))
    if len(set(labels)) < 2:
        raise InputError(f"{', '.join(cfg.data)}: need examples of both labels, got only label {labels[0] if labels else None}")
    return texts, np.array(labels, dtype=np.float64)


def fit_logistic_regression(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, y: np.ndarray,
                            cfg: TrainClassifierConfig) -> tuple[np.ndarray, float]:
    """Mini-batch Adagrad on the mean log loss plus (l2/2)·|w|², touching only the batch's features."""
    rng = np.random.default_rng(cfg.seed)
    w = np.zeros(1 << cfg.hash_bits, dtype=np.float64)
    g2 = np.zeros_like(w)
    bias, bias_g2, eps = 0.0, 0.0, 1e-8
    n = len(y)
    for _ in range(cfg.epochs):
        order = rng.permutation(n)
        for start in range(0, n, cfg.batch_size):
            batch = order[start : start + cfg.batch_size]
            lo, hi = indptr[batch], indptr[batch + 1]
            idx = np.concatenate([indices[a:b] for a, b in zip(lo, hi)])
            val = np.concatenate([values[a:b] for a, b in zip(lo, hi)])
            rows = np.repeat(np.arange(len(batch)), hi - lo)
            z = np.bincount(rows, weights=w[idx] * val, minlength=len(batch)) + bias
            err = (_sigmoid(z) - y[batch]) / len(batch)  # d(mean log loss)/dz
            touched, inverse = np.unique(idx, return_inverse=True)
            grad = np.bincount(inverse, weights=val * err[rows], minlength=len(touched)) + cfg.l2 * w[touched]
            g2[touched] += grad * grad
            w[touched] -= cfg.learning_rate * grad / (np.sqrt(g2[touched]) + eps)
            bias_grad = float(err.sum())
            bias_g2 += bias_grad * bias_grad
            bias -= cfg.learning_rate * bias_grad / (math.sqrt(bias_g2) + eps)
    return w.astype(np.float32), bias


def train_classifier(cfg: TrainClassifierConfig) -> dict:
    """Fit the classifier on the labelled data, report held-out accuracy, save it to ``cfg.output``."""
    texts, y = read_labelled(cfg)
    order = np.random.default_rng(cfg.seed).permutation(len(texts))
    n_val = int(round(cfg.validation_fraction * len(texts)))
    val, train = order[:n_val], order[n_val:]
    indptr, indices, values = _feature_matrix(texts, cfg.hash_bits, cfg.ngrams, cfg.normalize)
    sub = lambda rows: _rows(indptr, indices, values, rows)  # noqa: E731
    w, bias = fit_logistic_regression(*sub(train), y[train], cfg)

    def metrics(rows: np.ndarray) -> dict:
        if len(rows) == 0:
            return {"examples": 0}
        p = np.clip(_sigmoid(_logits(w, bias, *sub(rows))), 1e-7, 1 - 1e-7)
        return {"examples": int(len(rows)), "accuracy": round(float(np.mean((p >= 0.5) == (y[rows] == 1))), 4),
                "log_loss": round(float(-np.mean(y[rows] * np.log(p) + (1 - y[rows]) * np.log(1 - p))), 4)}

    result = {"output": str(cfg.output), "train": metrics(train), "validation": metrics(val),
              "positive_fraction": round(float(y.mean()), 4)}
    info = {"train": result["train"], "validation": result["validation"], "data": list(cfg.data)}
    HashedNgramClassifier(w, bias, cfg.hash_bits, cfg.ngrams, cfg.normalize, info).save(cfg.output)
    return result


def _rows(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, ...]:
    lo, hi = indptr[rows], indptr[rows + 1]
    sub_ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    sub_ptr[1:] = np.cumsum(hi - lo)
    take = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)]) if len(rows) else np.empty(0, np.int64)
    return sub_ptr, indices[take], values[take]


# --------------------------------------------------------------------------- the cut, shared by both scores


class _ScoreCut:
    """index_shard: score and save; resolve: threshold or percentile -> cut; apply_shard: annotate and reject."""

    name: str
    reject_above: bool  # perplexity: high is bad; classifier: low is bad

    def __init__(self, threshold: float | None, percentile: float | None):
        self.threshold, self.percentile = threshold, percentile

    def score_documents(self, docs: list[Document]) -> np.ndarray:
        raise NotImplementedError

    @property
    def key(self) -> str:
        return f"{self.name}_score"

    def index_shard(self, shard: int, docs: list[Document], work_dir: Path) -> None:
        scores = self.score_documents(docs) if docs else np.empty(0)
        atomic_write_npy(Path(work_dir) / "scores" / f"s{shard:06d}.npy", np.asarray(scores, dtype=np.float64))

    def resolve(self, work_dir: Path, num_shards: int, pool_map: PoolMap) -> None:
        work_dir = Path(work_dir)
        cut, rule = self.threshold, "threshold"
        if self.percentile is not None:
            scores = np.concatenate([_load_scores(work_dir, s) for s in range(num_shards)])
            finite = scores[np.isfinite(scores)]
            cut = float(np.percentile(finite, self.percentile)) if len(finite) else None
            rule = f"{_ordinal(self.percentile)} percentile"
        atomic_write_json(work_dir / "cut.json", {"cut": cut, "rule": rule, "reject": "above" if self.reject_above else "below"})

    def apply_shard(self, shard: int, docs: list[Document], work_dir: Path) -> list[str | None]:
        work_dir = Path(work_dir)
        scores = _load_scores(work_dir, shard)
        if len(scores) != len(docs):
            raise RuntimeError(f"{self.name}: shard {shard} holds {len(docs)} documents but {len(scores)} were scored; "
                               f"rerun the step's index phase")
        cut_info = read_json(work_dir / "cut.json", f"{self.name} cut")
        cut = cut_info["cut"]
        decisions: list[str | None] = []
        for doc, score in zip(docs, scores.tolist()):
            if not math.isfinite(score):
                decisions.append(f"{self.key} undefined (no tokens to score)")
                continue
            doc.metadata[self.key] = round(score, 6)
            bad = cut is not None and (score > cut if self.reject_above else score < cut)
            decisions.append(f"{self.key} {'>' if self.reject_above else '<'} {cut:.6g} ({cut_info['rule']})" if bad else None)
        return decisions


def _load_scores(work_dir: Path, shard: int) -> np.ndarray:
    path = work_dir / "scores" / f"s{shard:06d}.npy"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing; index_shard has not run for shard {shard}")
    return np.load(path)


def _ordinal(p: float) -> str:
    text = f"{p:g}"
    if "." in text:
        return text + "th"
    n = int(text)
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


# --------------------------------------------------------------------------- the classifier step


@dataclass
class ClassifierConfig:
    """Score documents with a trained hashed n-gram classifier; reject those below the cut."""

    model: str = option("", help="the folder `lmforge curate train-classifier` wrote (required)")
    threshold: float | None = unit_interval(
        None, help="reject the documents whose P(keep) is below this (null, and no percentile: score only)"
    )
    percentile: float | None = in_range(
        None, 0, 100, low_open=True, high_open=True,
        help="or: reject the documents below this percentile of this run's scores",
    )

    def __post_init__(self) -> None:
        _check_cut("classifier", self.threshold, self.percentile)
        check_ranges(self, "classifier.")  # built in Python too

    def check_inputs(self, where: str) -> None:
        """Before any work (``run_curate``): ``model`` names a classifier that loads; the error names
        the key (``where``: the step, as ``steps[2]``) and the path, rather than a worker's traceback."""
        if not self.model:
            raise ConfigError(f"{where}.model is required: the folder written by `lmforge curate train-classifier`")
        if not Path(self.model).is_dir():
            raise InputError(f"{where}.model: {self.model}: no such folder (the classifier step's model: the folder "
                             f"written by `lmforge curate train-classifier`)")
        try:
            HashedNgramClassifier.load(self.model)
        except InputError as exc:
            raise InputError(f"{where}.model: {exc}") from exc


class ClassifierScore(_ScoreCut):
    name = "classifier"
    reject_above = False

    def __init__(self, cfg: ClassifierConfig):
        if not cfg.model:
            raise ValueError("classifier.model is required: the directory written by `lmforge curate train-classifier`")
        super().__init__(cfg.threshold, cfg.percentile)
        self.cfg = cfg
        self._model: HashedNgramClassifier | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_model": None}

    def score_documents(self, docs: list[Document]) -> np.ndarray:
        if self._model is None:
            self._model = HashedNgramClassifier.load(self.cfg.model)
        return self._model.score([d.text for d in docs])


# --------------------------------------------------------------------------- the perplexity step


@dataclass
class PerplexityConfig:
    """Score documents by perplexity under an lmforge language model (CCNet); reject those above the cut."""

    checkpoint: str = option(
        "", help="an lmforge checkpoint folder, or a run directory (its newest checkpoint) (required)"
    )
    unit: Literal["perplexity", "bits_per_byte"] = option(
        "perplexity", help="what the score and the cut are in: perplexity, or bits per byte of the text"
    )
    threshold: float | None = positive(
        None, help="reject the documents scoring above this (null, and no percentile: score only)"
    )
    percentile: float | None = in_range(
        None, 0, 100, low_open=True, high_open=True,
        help="or: reject the documents above this percentile of this run's scores",
    )
    max_tokens: int = positive(
        512, help="score the first N tokens of each document (capped by the model's max_seq_len)"
    )
    batch_tokens: int = positive(16384, help="padded tokens per forward pass")
    device: str = option("cpu", help="where the model runs: cpu, cuda, cuda:1, ...")

    def __post_init__(self) -> None:
        _check_cut("perplexity", self.threshold, self.percentile)
        check_ranges(self, "perplexity.")  # built in Python too

    def check_inputs(self, where: str) -> None:
        """Before any work (``run_curate``): ``checkpoint`` names an lmforge checkpoint, or a run
        directory with checkpoints (which the step verifies when it loads the newest); the error names
        the key (``where``: the step, as ``steps[2]``) and the path, rather than a worker's traceback."""
        if not self.checkpoint:
            raise ConfigError(f"{where}.checkpoint is required: an lmforge checkpoint or run directory")
        if not Path(self.checkpoint).exists():
            raise InputError(f"{where}.checkpoint: {self.checkpoint}: no such checkpoint or run directory")
        from lmforge.checkpoints.load import checkpoint_dirs, resolve_checkpoint

        if checkpoint_dirs(self.checkpoint):
            return
        try:
            resolve_checkpoint(self.checkpoint, verify=False)
        except InputError as exc:
            raise InputError(f"{where}.checkpoint: {exc}") from exc


class PerplexityScore(_ScoreCut):
    name = "perplexity"
    reject_above = True

    def __init__(self, cfg: PerplexityConfig):
        if not cfg.checkpoint:
            raise ValueError("perplexity.checkpoint is required: an lmforge checkpoint or run directory")
        super().__init__(cfg.threshold, cfg.percentile)
        self.cfg = cfg
        self._loaded = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_loaded": None}

    def _load(self):
        if self._loaded is None:
            import torch

            from lmforge.checkpoints.load import load_model
            from lmforge.data.tokenizer import Tokenizer, token_byte_lengths

            model, directory = load_model(self.cfg.checkpoint, device=self.cfg.device)
            model.eval()
            tok = Tokenizer.load(directory)
            token_bytes = torch.tensor(token_byte_lengths(tok), dtype=torch.float64, device=self.cfg.device)
            self._loaded = (model, tok, token_bytes)
        return self._loaded

    def score_documents(self, docs: list[Document]) -> np.ndarray:
        model, tok, token_bytes = self._load()
        nll, n_tokens, n_bytes = document_nll(model, tok, [d.text for d in docs], self.cfg.max_tokens,
                                              self.cfg.batch_tokens, token_bytes)
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.cfg.unit == "perplexity":
                return np.where(n_tokens > 0, np.exp(nll / n_tokens), np.nan)
            return np.where(n_bytes > 0, nll / (math.log(2) * n_bytes), np.nan)


def document_nll(model, tok, texts: list[str], max_tokens: int, batch_tokens: int,
                 token_bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Summed next-token NLL (nats), scored tokens and their UTF-8 bytes for each text.

    Each text is ``[BOS] + tokens`` cut to ``max_tokens`` targets; texts are sorted by length
    and padded on the right into batches of about ``batch_tokens`` tokens (right padding
    cannot change a causal model's outputs at the real positions).
    """
    import torch
    import torch.nn.functional as F

    from lmforge.data.packing import IGNORE_INDEX

    max_tokens = min(max_tokens, model.cfg.max_seq_len - 1)
    seqs = [[tok.bos_id, *ids[:max_tokens]] for ids in tok.encode_batch(texts)]
    nll, n_tokens, n_bytes = np.zeros(len(texts)), np.zeros(len(texts), np.int64), np.zeros(len(texts))
    device = next(model.parameters()).device
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    start = 0
    with torch.no_grad():
        while start < len(order):
            width = len(seqs[order[start]])
            stop = start + max(1, batch_tokens // width)
            batch = order[start:stop]
            rows = torch.full((len(batch), width), tok.pad_id, dtype=torch.long)
            targets = torch.full((len(batch), width - 1), IGNORE_INDEX, dtype=torch.long)
            for r, i in enumerate(batch):
                seq = torch.tensor(seqs[i])
                rows[r, : len(seq)] = seq
                targets[r, : len(seq) - 1] = seq[1:]
            rows, targets = rows.to(device), targets.to(device)
            if width > 1:
                logits = model(rows[:, :-1])
                losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                                         reduction="none").view(len(batch), width - 1)
                mask = targets != IGNORE_INDEX
                nll[batch] = losses.sum(dim=1).double().cpu().numpy()
                n_tokens[batch] = mask.sum(dim=1).cpu().numpy()
                n_bytes[batch] = (token_bytes[targets.clamp(min=0)] * mask).sum(dim=1).cpu().numpy()
            start = stop
    return nll, n_tokens, n_bytes
