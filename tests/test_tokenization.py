import numpy as np

from xmcbench.storage import cache_dir
from xmcbench.tokenization import tokenize


class CountingTokenizer:
    """Wraps a real tokenizer and counts calls, to prove the cache is used."""

    def __init__(self, tokenizer):
        self.inner, self.calls = tokenizer, 0
        self.pad_token_id, self.padding_side = tokenizer.pad_token_id, tokenizer.padding_side
        self.backend_tokenizer = tokenizer.backend_tokenizer

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_tokens_are_cached_and_batches_pad_to_the_longest(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    texts = ["a short one", "a somewhat longer text about python packages", ""]
    first = tokenize(texts, tokenizer, max_length=8, texts_key="demo/train")
    second = tokenize(texts, tokenizer, max_length=8, texts_key="demo/train")
    assert tokenizer.calls == 1
    assert list((cache_dir() / "tokens").glob("*.npz"))
    np.testing.assert_array_equal(first.ids, second.ids)
    assert first.lengths.tolist() == [5, 8, 2]   # [CLS] ... [SEP], truncated to 8

    ids, mask = first.batch(np.array([0, 2]))
    assert ids.shape == (2, 5) and mask.sum(1).tolist() == [5, 2]
    assert (ids[1, 2:] == tokenizer.pad_token_id).all()

    tokenize(texts, tokenizer, max_length=16, texts_key="demo/train")
    assert tokenizer.calls == 2, "another max length is another cache entry"
