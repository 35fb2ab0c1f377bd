import dataclasses
import math

import numpy as np
import pytest
import torch

from lmforge.core.config import ConfigError, load_config
from lmforge.core.io import InputError
from lmforge.data.loader import DatasetSource, LoaderConfig, TokenLoader
from lmforge.data.noising import (
    BertMasking,
    MaskingConfig,
    NoisedLoader,
    PrefixSplit,
    SpanConfig,
    SpanCorruption,
    noise_batch,
    noise_span_to_unique_sentinel,
    random_spans_noise_mask,
    span_raw_length,
)
from lmforge.data.packing import IGNORE_INDEX

VOCAB, MASK_ID, SPECIALS = 1000, 5, list(range(8))  # ids 0..7 special, 5 the mask


def within(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    """``count`` successes of ``n`` trials is within ``sigmas`` binomial standard deviations of ``n p``."""
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def masked_sample(n_rows: int = 400, T: int = 250):
    """1e5 positions of ordinary tokens (a few specials among them), masked row by row as training masks them."""
    rng = np.random.default_rng(0)
    windows = rng.integers(8, VOCAB, (n_rows, T + 1))
    windows[:, 0] = 0  # a BOS at every row's start, never selected
    noise = BertMasking(MaskingConfig(), MASK_ID, SPECIALS, VOCAB)
    batch = noise_batch(torch.from_numpy(windows), noise, seed=0, samples=n_rows, first_row=0)
    return windows[:, :-1], batch


def rates(original: np.ndarray, inputs: np.ndarray, labels: np.ndarray) -> dict[str, int]:
    selected = labels != IGNORE_INDEX
    return {"ordinary": int((original >= 8).sum()), "selected": int(selected.sum()),
            "masked": int((selected & (inputs == MASK_ID)).sum()),
            "random": int((selected & (inputs != MASK_ID) & (inputs != original)).sum()),
            "kept": int((selected & (inputs == original)).sum())}


def test_bert_masking_selects_15_percent_then_80_10_10_within_binomial_error_as_transformers_collator_does():
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    original, batch = masked_sample()
    ours = rates(original, batch["input_ids"].numpy(), batch["labels"].numpy())
    n = ours["ordinary"]
    assert n == 400 * 249 and (original == 0).sum() == 400  # ~1e5 positions that may be selected
    assert int((batch["labels"][:, 0] != IGNORE_INDEX).sum()) == 0  # the BOS never is
    assert within(ours["selected"], n, 0.15)
    s = ours["selected"]
    # a random token equal to the original one (1 in 992) counts as kept, as in the collator
    assert within(ours["masked"], s, 0.8) and within(ours["random"], s, 0.1 * 991 / 992)
    assert within(ours["kept"], s, 0.1 + 0.1 / 992)
    assert bool((batch["input_ids"][batch["labels"] == IGNORE_INDEX] == torch.from_numpy(original)[
        batch["labels"] == IGNORE_INDEX]).all())  # unselected positions are the original tokens
    assert torch.equal(batch["prefix_len"], torch.full((400,), 250))  # bidirectional rows

    # transformers' collator on the same tokens, with the same vocabulary and specials
    vocab = {f"t{i}": i for i in range(VOCAB)}
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                 mask_token="t5", bos_token="t0", additional_special_tokens=[f"t{i}" for i in SPECIALS])
    collator = DataCollatorForLanguageModeling(hf, mlm_probability=0.15, seed=0, return_tensors="pt")
    theirs_in, theirs_labels = collator.torch_mask_tokens(torch.from_numpy(original.copy()),
                                                          special_tokens_mask=torch.from_numpy(original < 8))
    theirs = rates(original, theirs_in.numpy(), theirs_labels.numpy())
    for key, p in (("selected", 0.15), ("masked", 0.15 * 0.8), ("random", 0.15 * 0.1), ("kept", 0.15 * 0.1)):
        se = math.sqrt(2 * n * p * (1 - p))  # of the difference of two independent binomial counts
        assert abs(ours[key] - theirs[key]) <= 4 * se, (key, ours[key], theirs[key])


def test_bert_masking_never_selects_special_tokens_and_replaces_only_with_ordinary_ones():
    original, batch = masked_sample(n_rows=100)
    inputs, labels = batch["input_ids"], batch["labels"]
    randomized = (labels != IGNORE_INDEX) & (inputs != MASK_ID) & (inputs != torch.from_numpy(original))
    assert int(randomized.sum()) > 0 and bool((inputs[randomized] >= 8).all())
    assert bool((labels[labels != IGNORE_INDEX] >= 8).all())


def t5_random_spans_noise_mask(length, noise_density, mean_noise_span_length, shuffle):
    """T5's ``random_spans_noise_mask`` (t5/data/preprocessors.py), its TensorFlow ops written in numpy
    here, independently of lmforge's, with ``shuffle`` in place of ``seqio.stateless_shuffle``."""
    orig_length = length
    length = max(length, 2)
    num_noise_tokens = int(np.round(np.float32(length) * noise_density))
    num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)
    num_noise_spans = max(int(np.round(np.float32(num_noise_tokens) / mean_noise_span_length)), 1)
    num_nonnoise_tokens = length - num_noise_tokens

    def _random_segmentation(num_items, num_segments):
        first_in_segment = np.pad(shuffle((np.arange(num_items - 1) < num_segments - 1).astype(np.int64)), [[1, 0]])
        segment_id = np.cumsum(first_in_segment)
        return np.array([np.sum(segment_id == i) for i in range(num_segments)])  # tf.math.segment_sum of ones

    noise_span_lengths = _random_segmentation(num_noise_tokens, num_noise_spans)
    nonnoise_span_lengths = _random_segmentation(num_nonnoise_tokens, num_noise_spans)
    interleaved = np.reshape(np.stack([nonnoise_span_lengths, noise_span_lengths], axis=1), [num_noise_spans * 2])
    span_starts = np.cumsum(interleaved)[:-1]
    span_start_indicator = np.zeros(length, dtype=np.int64)
    np.add.at(span_start_indicator, span_starts, 1)  # tf.math.unsorted_segment_sum
    span_num = np.cumsum(span_start_indicator)
    return np.equal(span_num % 2, 1)[:orig_length]


@pytest.mark.parametrize("length", [2, 7, 30, 114, 233, 512])
@pytest.mark.parametrize("density,mean", [(0.15, 3.0), (0.5, 2.0), (0.3, 8.0)])
def test_random_spans_noise_mask_is_t5s_given_the_same_shuffles(length, density, mean):
    for seed in range(5):
        ours = random_spans_noise_mask(length, density, mean, np.random.RandomState(seed))
        reference_rng = np.random.RandomState(seed)

        def shuffle(a, rng=reference_rng):
            rng.shuffle(a)
            return a

        assert np.array_equal(ours, t5_random_spans_noise_mask(length, density, mean, shuffle))


def test_noise_spans_have_t5s_density_and_mean_length_and_start_after_a_kept_span():
    rng = np.random.default_rng(0)
    lengths, noise = [], 0
    for _ in range(2000):
        mask = random_spans_noise_mask(233, 0.15, 3.0, rng)
        assert not mask[0] and mask[-1]  # a kept span first, a noise span last
        noise += int(mask.sum())
        starts = np.flatnonzero(mask & ~np.r_[False, mask[:-1]])
        ends = np.flatnonzero(mask & ~np.r_[mask[1:], False])
        lengths += (ends - starts + 1).tolist()
    assert noise == 2000 * 35  # round(233 * 0.15)
    assert len(lengths) == 2000 * 12 and abs(np.mean(lengths) - 35 / 12) < 1e-9  # round(35 / 3) spans a row


def test_span_corruption_row_is_the_inputs_with_sentinels_then_the_sentinel_separated_targets():
    sentinels = [900 + i for i in range(20)]
    noise = SpanCorruption(SpanConfig(), sentinels, pad_id=2, seq_len=64)
    assert noise.raw_len + 2 * noise.spans <= 65 and noise.raw_len == span_raw_length(65, 0.15, 3.0)
    window = np.arange(100, 165)
    inputs, labels, prefix = noise(window, np.random.default_rng(1))
    x = inputs[:prefix]
    y = labels[prefix - 1 :][labels[prefix - 1 :] != IGNORE_INDEX]
    assert list(x[x >= 900]) == sentinels[: noise.spans] == list(y[y >= 900])  # one sentinel a span, in order
    assert y[0] == 900 and x[-1] == 900 + noise.spans - 1  # targets open with <extra_id_0>; inputs end with the last
    # the targets fill the inputs' sentinels back in: the window's tokens, in order
    cuts = [*np.flatnonzero(y >= 900), len(y)]
    fills = {int(y[a]): y[a + 1 : b] for a, b in zip(cuts, cuts[1:])}
    rebuilt = np.concatenate([fills[int(t)] if t >= 900 else [t] for t in x])
    assert np.array_equal(rebuilt, window[: noise.raw_len])
    assert (labels[: prefix - 1] == IGNORE_INDEX).all()  # no loss on the inputs
    assert np.array_equal(labels[prefix - 1 : prefix - 1 + len(y)], y)  # each target from the position before it
    assert (inputs[prefix + len(y) - 1 :] == 2).all()  # then padding, without loss


def test_noise_span_to_unique_sentinel_is_t5s_on_its_example():
    tokens = np.array([10, 11, 12, 13, 14, 15, 16])  # "Thank you <for inviting> me to your party <last> week"
    noise = np.array([0, 0, 1, 1, 0, 1, 0], dtype=bool)
    sentinels = np.array([99, 98, 97])
    assert list(noise_span_to_unique_sentinel(tokens, noise, sentinels)) == [10, 11, 99, 14, 98, 16]
    assert list(noise_span_to_unique_sentinel(tokens, ~noise, sentinels)) == [99, 12, 13, 98, 15, 97]


def test_span_corruption_needs_a_sentinel_per_span_and_room_for_the_kept_tokens():
    with pytest.raises(InputError, match=r"tokenizer has 3 sentinel tokens.*tokenizer.sentinel_tokens=100"):
        SpanCorruption(SpanConfig(), [900, 901, 902], pad_id=2, seq_len=256)
    with pytest.raises(InputError, match="span.noise_density"):
        SpanCorruption(SpanConfig(noise_density=0.9, mean_span_length=1.0), list(range(900, 1000)), 2, 64)


@pytest.mark.parametrize("density", [0, 1, 1.5, -0.1])
def test_span_noise_density_outside_0_1_is_a_config_error_naming_the_key(density):
    from lmforge.stages.pretrain import PretrainRecipe

    with pytest.raises(ConfigError, match=r"span\.noise_density"):
        load_config(PretrainRecipe, None, [f"span.noise_density={density}"])


def test_masking_shares_above_one_are_a_config_error():
    from lmforge.stages.pretrain import PretrainRecipe

    with pytest.raises(ConfigError, match=r"mlm.*mask_replace_prob \+ random_replace_prob"):
        load_config(PretrainRecipe, None, ["mlm.mask_replace_prob=0.9", "mlm.random_replace_prob=0.2"])


def test_prefix_split_predicts_every_token_after_a_random_prefix():
    window = np.arange(10, 43)
    seen = set()
    for seed in range(200):
        inputs, labels, prefix = PrefixSplit()(window, np.random.default_rng(seed))
        seen.add(prefix)
        assert np.array_equal(inputs, window[:-1]) and 1 <= prefix <= 32
        assert (labels[: prefix - 1] == IGNORE_INDEX).all() and np.array_equal(labels[prefix - 1 :], window[prefix:])
    assert seen == set(range(1, 33))


@pytest.fixture()
def loader_cfg(shards_dir_noising) -> LoaderConfig:
    return LoaderConfig(datasets=[DatasetSource(str(shards_dir_noising))], seq_len=16, seed=3)


@pytest.fixture(scope="module")
def shards_dir_noising(tmp_path_factory, small_tokenizer_dir, corpus_texts):
    from lmforge.data.documents import DocumentsConfig
    from lmforge.stages.prepare import PrepareRecipe, run_prepare
    from tests.conftest import write_jsonl

    root = tmp_path_factory.mktemp("noising")
    docs = write_jsonl(root / "docs.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(corpus_texts)])
    run_prepare(PrepareRecipe(run_dir=str(root / "shards"), tokenizer=str(small_tokenizer_dir),
                              data=DocumentsConfig(paths=[str(docs)]), val_fraction=0.1))
    return root / "shards"


NOISES = {"mlm": BertMasking(MaskingConfig(), 4, [0, 1, 2, 3, 4], 512), "prefix_lm": PrefixSplit(),
          "span": SpanCorruption(SpanConfig(), list(range(400, 420)), 2, 16)}


@pytest.mark.parametrize("name", sorted(NOISES))
def test_a_resumed_loader_draws_the_masks_an_uninterrupted_one_draws(loader_cfg, name):
    full = NoisedLoader(TokenLoader(loader_cfg, 4), NOISES[name])
    batches = [next(full) for _ in range(6)]
    first = NoisedLoader(TokenLoader(loader_cfg, 4), NOISES[name])
    for _ in range(3):
        next(first)
    resumed = NoisedLoader(TokenLoader(loader_cfg, 4), NOISES[name])
    resumed.load_state_dict(first.state_dict())
    for expected in batches[3:]:
        got = next(resumed)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    again = next(NoisedLoader(TokenLoader(loader_cfg, 4), NOISES[name]))
    assert all(torch.equal(again[k], batches[0][k]) for k in batches[0])  # the same seed, the same masks
    other = next(NoisedLoader(TokenLoader(dataclasses.replace(loader_cfg, seed=4), 4), NOISES[name]))
    assert not all(torch.equal(other[k], batches[0][k]) for k in batches[0])


def test_the_masks_do_not_depend_on_how_the_batch_is_split_over_data_parallel_ranks(loader_cfg):
    noise = NOISES["mlm"]
    whole = next(NoisedLoader(TokenLoader(loader_cfg, 8), noise))
    halves = [next(NoisedLoader(TokenLoader(loader_cfg, 4, rank=r, world_size=2), noise)) for r in (0, 1)]
    for key in whole:
        assert torch.equal(torch.cat([h[key] for h in halves]), whole[key])


def test_an_empty_last_validation_batch_stays_empty():
    batch = noise_batch(torch.zeros(0, 17, dtype=torch.long), PrefixSplit(), 0, 0, 0)
    assert batch["input_ids"].shape == (0, 16) and batch["prefix_len"].shape == (0,)
