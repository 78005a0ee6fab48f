"""load_tokenizer remembers the class AutoTokenizer chose for a folder, per the files it chose from."""

import shutil

import pytest

from engine.models.model_path import resolve_model_path
from engine.tokenizer import load_tokenizer


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    source = resolve_model_path("pagedserve-tiny", weights=False)
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja"):
        shutil.copy(source / name, folder / name)
    return folder


def _records(folder):
    return sorted((folder.parent / "cache" / "tokenizer-classes").glob("*"))


def test_the_chosen_class_is_remembered_and_loads_the_same_tokenizer(checkpoint):
    first = load_tokenizer(checkpoint)
    [record] = _records(checkpoint)
    assert record.read_text() == type(first).__name__ == "LlamaTokenizer"
    second = load_tokenizer(checkpoint)  # from the record
    text = "Hello <s> wörld\n  spaces"
    assert type(second) is type(first)
    assert second(text).input_ids == first(text).input_ids
    assert second.chat_template == first.chat_template and second.eos_token_id == first.eos_token_id


def test_a_changed_tokenizer_config_is_chosen_for_again(checkpoint):
    load_tokenizer(checkpoint)
    config = checkpoint / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"LlamaTokenizer"', '"PreTrainedTokenizerFast"'))
    load_tokenizer(checkpoint)
    assert len(_records(checkpoint)) == 2


def test_a_bad_record_falls_back_to_auto_tokenizer(checkpoint):
    load_tokenizer(checkpoint)
    [record] = _records(checkpoint)
    record.write_text("NotATokenizerClass")
    assert type(load_tokenizer(checkpoint)).__name__ == "LlamaTokenizer"
    assert record.read_text() == "LlamaTokenizer"
