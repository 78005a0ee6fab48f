"""Incremental detokenization: deltas that add up to the full decode, byte-fallback pieces never split,
stop strings found across token boundaries."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from engine.frontend.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def stream(tokenizer, ids, prompt=(), chunk=1, **kwargs) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    detok = IncrementalDetokenizer(tokenizer, list(prompt), **kwargs)
    deltas, stop = [], None
    for i in range(0, len(ids), chunk):
        stop = detok.update(ids[i : i + chunk], final=i + chunk >= len(ids))
        finished = stop is not None or i + chunk >= len(ids)
        deltas.append(detok.get_delta(finished))
        if stop is not None:
            break
    return deltas, detok, stop


def test_random_sequences_stream_to_the_full_decode(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    byte_tokens = list(range(3, 259))  # <0x00>..<0xFF>: byte fallback
    for trial in range(300):
        n = rng.randint(1, 40)
        # Mix plain tokens, byte-fallback runs (often invalid or multi-byte UTF-8) and special tokens.
        ids = [rng.choice(byte_tokens) if rng.random() < 0.3 else rng.randrange(vocab) for _ in range(n)]
        for skip in (True, False):
            deltas, _, _ = stream(tokenizer, ids, chunk=rng.choice([1, 1, 3, 7, 40]), skip_special_tokens=skip)
            assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip), (trial, ids)


def test_multibyte_characters_are_never_split(tokenizer):
    text = "naïve café — 你好 🦜 龘𝔘𝔫𝔦 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(3 <= i < 259 for i in ids), "expected byte-fallback tokens in this text"
    deltas, _, _ = stream(tokenizer, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_word_boundary_after_the_prompt(tokenizer):
    prompt = tokenizer.encode("Hello", add_special_tokens=True)
    ids = tokenizer.encode("Hello world again", add_special_tokens=True)[len(prompt) :]
    deltas, _, _ = stream(tokenizer, ids, prompt=prompt)
    assert "".join(deltas) == " world again"  # the first output token keeps its leading space


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tokenizer, include):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    stop = "own fox ju"  # starts inside "brown", ends inside "jumps"
    assert not any(stop in tokenizer.decode([i]) for i in ids)  # it spans several tokens
    deltas, detok, hit = stream(tokenizer, ids, stop=[stop], include_stop_str_in_output=include)
    assert hit == stop
    expected = "The quick br" + (stop if include else "")
    assert detok.output_text == expected and "".join(deltas) == expected


def test_held_back_text_is_not_streamed_before_it_is_known(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["three four five"])
    streamed = ""
    for i in ids:
        assert detok.update([i]) is None
        streamed += detok.get_delta(finished=False)
        assert len(detok.output_text) - len(streamed) <= len("three four five") - 1
    streamed += detok.get_delta(finished=True)
    assert streamed == "one two three four"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    _, detok, hit = stream(tokenizer, ids, chunk=len(ids), stop=["delta", "beta", "gamma"])
    assert hit == "beta" and detok.output_text == "alpha "
