"""Helpers that several modules share, one function each: one-line error texts, the JSON reader, seeding
and what the pipeline asks a tokenizer for."""

import json
import random

import numpy as np
import pytest
import torch

from xmcbench import device, ensemble, modelio, registry, testing, tokenization
from xmcbench.errors import XmcError, error_line, first_line, joined_line
from xmcbench.storage import read_json


def test_error_texts_in_one_line():
    assert first_line("\n  \n  first  \nsecond") == "first"
    assert first_line("") == ""
    assert error_line(ValueError("\nbad value\nTraceback ...")) == "ValueError: bad value"
    assert error_line(KeyError()) == "KeyError"
    assert joined_line("a\n  b\r\n\tc ") == "a b c"
    # the modules use these, not copies of their own
    assert not hasattr(modelio, "one_line") and not hasattr(registry, "one_line")


def test_read_json_plain_raises_as_it_is(tmp_path):
    path = tmp_path / "value.json"
    path.write_text('{"a": [1, 2]}')
    assert read_json(path) == {"a": [1, 2]}
    path.write_text("{")
    with pytest.raises(json.JSONDecodeError):
        read_json(path)
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "absent.json")


@pytest.mark.parametrize("content, words", [
    (None, ["absent.json", "is missing", "the label list"]),
    (b"", ["not valid JSON", "it is empty", "the label list is damaged or truncated"]),
    (b'{"a": ', ["not valid JSON", "line 1 column", "damaged or truncated"]),
    (b"\xff\xfe{}", ["not valid JSON", "not UTF-8", "the label list is damaged"]),
])
def test_read_json_with_what_ends_in_one_xmc_error_line(tmp_path, content, words):
    path = tmp_path / "absent.json"
    if content is not None:
        path.write_bytes(content)
    for remedy in ("", "train again"):
        with pytest.raises(XmcError) as raised:
            read_json(path, "the label list", remedy)
        message = str(raised.value)
        assert "\n" not in message and str(path) in message
        assert all(word in message for word in words), message
        assert message.endswith("; train again") == bool(remedy)


def test_model_and_ensemble_files_are_read_by_the_one_reader(tmp_path):
    assert not hasattr(modelio, "_read_json") and not hasattr(ensemble, "_read_json_file")
    path = tmp_path / "ensemble.json"
    path.write_text("{")
    with pytest.raises(XmcError, match="is not valid JSON .*: the ensemble description is damaged or truncated"):
        ensemble.read_ensemble(tmp_path)


def test_the_conformance_checks_seed_as_the_pipeline_does():
    assert testing.seed_everything is device.seed_everything and not hasattr(testing, "_seed")
    device.seed_everything(3)
    drawn = random.random(), np.random.rand(), torch.rand(1).item()
    device.seed_everything(3)
    assert drawn == (random.random(), np.random.rand(), torch.rand(1).item())


class WordTokenizer:
    """A tokenizer called as Hugging Face's: one id per word, 1 and 2 around them, truncated."""

    padding_side, pad_token_id = "left", 0

    def __call__(self, texts, truncation, max_length, add_special_tokens, return_attention_mask,
                 return_token_type_ids):
        assert truncation and add_special_tokens and not return_attention_mask and not return_token_type_ids
        return {"input_ids": [([1] + [np.int64(3 + len(w)) for w in t.split()] + [2])[:max_length] for t in texts]}


def test_the_conformance_checks_call_the_tokenizer_as_tokenization_does():
    tokenizer, texts = WordTokenizer(), ["a bb ccc", "dddd " * 9]
    assert testing._token_ids(tokenizer, texts, 5) == tokenization.token_ids(tokenizer, texts, 5) == \
        [[1, 4, 5, 6, 2], [1, 7, 7, 7, 7]]
    assert all(type(i) is int for ids in testing._token_ids(tokenizer, texts, 5) for i in ids)
    assert tokenization.pads_left(tokenizer) and not tokenization.pads_left(object())
    assert tokenization.tokenize(texts, tokenizer, 5, None).pad_left
