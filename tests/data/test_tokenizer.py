import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from lmforge.core.io import InputError
from lmforge.data.tokenizer import Tokenizer, TokenizerConfig, compression_stats, train_tokenizer

SAMPLES = [
    "To be, or not to be, that is the question:",
    "  leading spaces and trailing  \n\n\tTabs\r\nCRLF",
    "Numbers 1234567 and 3.14159, dates 2026-11-29.",
    "Unicode: café naïve Ünïcödé — 東京 🦀🚀 ﷽ \u200b zero-width",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "<|begin_of_text|>text<|end_of_text|><|pad|>",
    "",
]


def test_special_tokens_take_the_first_ids_and_pad_differs_from_end_of_turn(small_tokenizer):
    tok = small_tokenizer
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert tok.token_to_id("<|im_start|>") == 3 and tok.token_to_id("<|im_end|>") == 4
    assert tok.pad_id not in (tok.eos_id, tok.token_to_id("<|im_end|>"))
    assert tok.vocab_size == 512


def test_special_tokens_encode_as_single_ids(small_tokenizer):
    ids = small_tokenizer.encode("<|im_start|>assistant\nhi<|im_end|>")
    assert ids[0] == 3 and ids[-1] == 4


def test_transformers_loads_the_saved_tokenizer_and_encodes_identically(small_tokenizer, small_tokenizer_dir):
    hf = PreTrainedTokenizerFast.from_pretrained(str(small_tokenizer_dir))
    assert hf.bos_token_id == 0 and hf.eos_token_id == 1 and hf.pad_token_id == 2
    for text in SAMPLES:
        ours = small_tokenizer.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ours
        assert hf.encode(text) == ours  # HF adds no BOS of its own: no double BOS later
        assert hf.decode(ours, skip_special_tokens=False) == text


def test_tokenizer_config_json_names_the_special_tokens(small_tokenizer_dir):
    cfg = json.loads((small_tokenizer_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["additional_special_tokens"] == ["<|im_start|>", "<|im_end|>"]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=200))
def test_decode_of_encode_is_the_identity_on_arbitrary_unicode(small_tokenizer, text):
    assert small_tokenizer.decode(small_tokenizer.encode(text)) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_of_encode_is_the_identity_on_tricky_samples(small_tokenizer, text):
    assert small_tokenizer.decode(small_tokenizer.encode(text)) == text


def test_batch_encoding_equals_single_encoding(small_tokenizer):
    assert small_tokenizer.encode_batch(SAMPLES) == [small_tokenizer.encode(s) for s in SAMPLES]


def test_training_is_deterministic(corpus_texts, small_tokenizer):
    again = train_tokenizer(corpus_texts, TokenizerConfig(vocab_size=512))
    assert again.sha256 == small_tokenizer.sha256


def test_digits_are_split_into_groups_of_at_most_three(small_tokenizer):
    pieces = [small_tokenizer.decode([i]) for i in small_tokenizer.encode("1234567")]
    assert "".join(pieces) == "1234567" and all(len(p) <= 3 for p in pieces)


def test_digit_group_one_gives_every_digit_its_own_token_in_transformers_too(corpus_texts, tmp_path):
    tok = train_tokenizer([*corpus_texts, "1234567 4600 46 " * 50], TokenizerConfig(vocab_size=512, digit_group=1))
    text = "How many centimetres are in 46 metres? 4600, and 3.14159."
    pieces = [tok.decode([i]) for i in tok.encode(text)]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("46" "4600" "3" "14159")
    tok.save(tmp_path)
    hf = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)


def test_compression_counts_bytes_and_tokens(small_tokenizer, corpus_texts):
    stats = compression_stats(small_tokenizer, corpus_texts[:5])
    n_bytes = sum(len(t.encode()) for t in corpus_texts[:5])
    n_tokens = sum(len(small_tokenizer.encode(t)) for t in corpus_texts[:5])
    assert stats["bytes"] == n_bytes and stats["tokens"] == n_tokens
    assert stats["bytes_per_token"] == pytest.approx(n_bytes / n_tokens)
    assert stats["bytes_per_token"] > 2.0  # even a 512-token BPE compresses English prose


def test_a_larger_vocabulary_compresses_better(corpus_texts, small_tokenizer):
    big = train_tokenizer(corpus_texts, TokenizerConfig(vocab_size=2048))
    held = corpus_texts[-5:]
    assert compression_stats(big, held)["bytes_per_token"] > compression_stats(small_tokenizer, held)["bytes_per_token"]


def test_invalid_configs_are_rejected():
    with pytest.raises(ValueError, match="distinct"):
        TokenizerConfig(pad_token="<|end_of_text|>")
    with pytest.raises(ValueError, match="at least 261"):
        TokenizerConfig(vocab_size=100)


def test_loading_a_missing_tokenizer_says_how_to_make_one(tmp_path):
    with pytest.raises(InputError, match="lmforge tokenizer"):
        Tokenizer.load(tmp_path)


def copy_tokenizer(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**config, **changes}))
    return dst


def test_special_tokens_written_as_added_token_mappings_load(small_tokenizer, small_tokenizer_dir, tmp_path):
    bos = small_tokenizer.config["bos_token"]
    d = copy_tokenizer(small_tokenizer_dir, tmp_path / "tok", bos_token={"__type": "AddedToken", "content": bos})
    assert Tokenizer.load(d).bos_id == small_tokenizer.bos_id


@pytest.mark.parametrize("value, message", [
    (None, r"bos_token is None; lmforge needs a BOS, an EOS and a pad token"),
    ({"__type": "AddedToken"}, r"bos_token is \{'__type': 'AddedToken'\}"),
    ("<|not-a-token|>", r"bos_token '<\|not-a-token\|>' is not in the vocabulary"),
])
def test_a_missing_or_unknown_special_token_names_the_file_and_key(small_tokenizer_dir, tmp_path, value, message):
    d = copy_tokenizer(small_tokenizer_dir, tmp_path / "tok", bos_token=value)  # Qwen's folders: "bos_token": null
    with pytest.raises(InputError, match=rf"^{d / 'tokenizer_config.json'}: {message}"):
        Tokenizer.load(d)


def test_a_mask_token_and_sentinels_come_last_among_the_special_tokens_and_transformers_reads_them(
        tmp_path, corpus_texts):
    cfg = TokenizerConfig(vocab_size=512, mask_token="[MASK]", sentinel_tokens=3)
    assert TokenizerConfig().special_tokens == cfg.special_tokens[:5]  # the default tokenizer is unchanged
    train_tokenizer(corpus_texts, cfg).save(tmp_path)
    tok = Tokenizer.load(tmp_path)
    assert (tok.mask_id, tok.sentinel_ids, tok.special_ids) == (5, [6, 7, 8], list(range(9)))
    assert tok.encode("a [MASK] b<extra_id_2>")[2] == 5 and tok.encode("<extra_id_2>") == [8]
    hf = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert hf.mask_token_id == 5 and hf.convert_tokens_to_ids("<extra_id_0>") == 6
    assert 6 in hf.all_special_ids and tok.vocab_size == 512


def test_a_tokenizer_without_them_has_no_mask_id_and_no_sentinels(small_tokenizer):
    assert small_tokenizer.mask_id is None and small_tokenizer.sentinel_ids == []
