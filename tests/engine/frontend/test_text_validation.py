"""The text checks every entry point shares: where an unpaired surrogate is, named as a field path,
and the tokenizer's bound on characters per token that lets a too-long prompt be refused untokenized."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.models.builtin import materialize_builtin
from engine.text_validation import check_text, invalid_text
from engine.tokenizer import load_tokenizer, max_chars_per_token
from tests.conftest import TINY


@pytest.mark.parametrize("value, message", [
    ("hi \udcff", "prompt: holds an unpaired UTF-16 surrogate U+DCFF at character 3;"),
    (["ok", {"content": [{"text": "\ud83d"}]}],
     "prompt.1.content.0.text: holds an unpaired UTF-16 surrogate U+D83D at character 0;"),
    ({"properties": {"a\udcffb": {}}},
     "prompt.properties: holds an unpaired UTF-16 surrogate U+DCFF at character 1 of the key 'a\\udcffb';"),
    # no field is named "a b"
    ({"a b": {"c": "\udfff"}}, "prompt: holds an unpaired UTF-16 surrogate U+DFFF at character 0;"),
])
def test_unpaired_surrogates_are_found_and_named_by_path(value, message):
    problem = invalid_text("prompt", value)
    assert problem is not None and problem.startswith(message)
    problem.encode()  # the message itself is valid text: it goes into a JSON reply
    with pytest.raises(ValueError, match="^prompt"):
        check_text("prompt", value)


@pytest.mark.parametrize("value", [
    "plain", "\U0001F600 a paired surrogate in JSON", "a\x00b\x1b", "\u202e\u05e9\u05dc", "e\u0301\u0323",
    ["x", {"k": ["\ufeff", 3, None]}], 42, None,
])
def test_valid_text_passes(value):
    assert invalid_text("prompt", value) is None


@pytest.fixture(scope="module")
def tiny_tokenizer():
    tokenizer = load_tokenizer(materialize_builtin(TINY))
    return tokenizer, max_chars_per_token(tokenizer)  # the bound reads the whole vocabulary: once


@settings(max_examples=150, deadline=None)
@given(st.text(st.characters(exclude_categories=["Cs"]), max_size=60).map(lambda s: s * 3)
       | st.builds(lambda c, n: c * n, st.characters(exclude_categories=["Cs"]), st.integers(1, 300)))
def test_no_token_covers_more_characters_than_the_bound(tiny_tokenizer, text):
    tokenizer, bound = tiny_tokenizer
    assert bound == 16
    assert len(tokenizer.encode(text, add_special_tokens=False)) * bound >= len(text)


def _fast(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def test_tokenizers_that_may_drop_characters_give_no_bound():
    vocab = {"[UNK]": 0, "a": 1, "b": 2}
    bert = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    bert.pre_tokenizer = pre_tokenizers.BertPreTokenizer()  # drops whitespace
    assert max_chars_per_token(_fast(bert)) is None
    stripping = Tokenizer(models.BPE(vocab, [], unk_token="[UNK]"))
    stripping.normalizer = normalizers.StripAccents()  # drops combining marks
    assert max_chars_per_token(_fast(stripping)) is None
    fused = Tokenizer(models.BPE(vocab, [], unk_token="[UNK]", fuse_unk=True))  # unknown runs -> one token
    assert max_chars_per_token(_fast(fused)) is None


def test_composing_normalizers_widen_the_bound():
    bpe = Tokenizer(models.BPE({"a": 0, "bb": 1, "[UNK]": 2}, [], unk_token="[UNK]"))
    bpe.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(" ", "\u2581")])
    assert max_chars_per_token(_fast(bpe)) == 4 * 5  # NFC may fold four code points into one; "[UNK]" is 5
