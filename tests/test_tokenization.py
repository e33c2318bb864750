import numpy as np
import pytest

from xmcbench.errors import XmcError
from xmcbench.tokenization import cache_entry, tokenize

TEXTS = ["a short one", "a somewhat longer text about python packages and their build dependencies", "",
         "libfoo-dev [SEP] [CLS] ünïcödé 日本語  tabs\tand\nnewlines", "   ", "x " * 300, "python3-numpy"]


class CountingTokenizer:
    """Wraps a real tokenizer and counts calls, to prove the cache is used. Not a Hugging Face tokenizer
    class, so tokenize() calls it rather than its backend."""

    def __init__(self, tokenizer, fail_on_call: int | None = None):
        self.inner, self.calls, self.fail_on_call = tokenizer, 0, fail_on_call
        self.pad_token_id, self.padding_side = tokenizer.pad_token_id, tokenizer.padding_side
        self.backend_tokenizer = tokenizer.backend_tokenizer

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("killed while tokenizing")
        return self.inner(*args, **kwargs)


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def assert_same_documents(first, second) -> None:
    assert len(first) == len(second)
    rows = np.arange(len(first))
    for a, b in zip(first.batch(rows), second.batch(rows)):
        assert a.equal(b)


def test_tokens_are_cached_and_batches_pad_to_the_longest(tokenizer):
    tokenizer = CountingTokenizer(tokenizer)
    texts = ["a short one", "a somewhat longer text about python packages", ""]
    first = tokenize(texts, tokenizer, max_length=8, texts_key="demo/train")
    second = tokenize(texts, tokenizer, max_length=8, texts_key="demo/train")
    assert tokenizer.calls == 1
    assert (cache_entry("demo/train", tokenizer, 8) / "ids.bin").is_file()
    np.testing.assert_array_equal(first.ids, second.ids)
    assert first.lengths.tolist() == [5, 8, 2]   # [CLS] ... [SEP], truncated to 8

    ids, mask = first.batch(np.array([0, 2]))
    assert ids.shape == (2, 5) and mask.sum(1).tolist() == [5, 2]
    assert (ids[1, 2:] == tokenizer.pad_token_id).all()

    tokenize(texts, tokenizer, max_length=16, texts_key="demo/train")
    assert tokenizer.calls == 2, "another max length is another cache entry"


def test_the_cache_is_memory_mapped_and_gives_the_same_batches_as_tokenizing_in_memory(tokenizer):
    in_memory = tokenize(TEXTS, tokenizer, max_length=16, texts_key=None)
    written = tokenize(TEXTS, tokenizer, max_length=16, texts_key="round-trip/train")
    read = tokenize(TEXTS, tokenizer, max_length=16, texts_key="round-trip/train")
    assert not isinstance(in_memory.ids, np.memmap)
    assert isinstance(written.ids, np.memmap) and isinstance(read.ids, np.memmap)
    assert not read.ids.flags.writeable
    for tokens in (written, read):
        np.testing.assert_array_equal(tokens.ids, in_memory.ids)
        np.testing.assert_array_equal(tokens.starts, in_memory.starts)
        assert_same_documents(tokens, in_memory)
    assert in_memory.lengths.dtype == np.int64 and in_memory.starts.dtype == np.int64


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_batches_equal_the_tokenizers_own_padding(tiny_model_dir, padding_side):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), padding_side=padding_side)
    tokens = tokenize(TEXTS, tokenizer, max_length=12, texts_key=f"padding-{padding_side}/train")
    rows = np.array([3, 0, 2, 5])
    input_ids, attention_mask = tokens.batch(rows)
    expected = tokenizer([TEXTS[row] for row in rows], truncation=True, max_length=12, padding=True,
                         return_tensors="pt", return_token_type_ids=False)
    assert input_ids.dtype == attention_mask.dtype == expected["input_ids"].dtype
    assert input_ids.equal(expected["input_ids"]) and attention_mask.equal(expected["attention_mask"])
    assert (attention_mask[:, 0 if padding_side == "left" else -1] == 0).any(), "some row is padded"


def test_the_backend_gives_the_ids_of_calling_the_tokenizer(tiny_model_dir, monkeypatch):
    from transformers import AutoTokenizer

    for truncation_side in ("right", "left"):
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), truncation_side=truncation_side)
        through_call = tokenize(TEXTS, CountingTokenizer(tokenizer), max_length=10, texts_key=None, batch_size=3)
        calls = []
        call = type(tokenizer).__call__
        monkeypatch.setattr(type(tokenizer), "__call__", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
        through_backend = tokenize(TEXTS, tokenizer, max_length=10, texts_key=None, batch_size=3)
        monkeypatch.undo()
        assert len(calls) == 1, "the tokenizer checks the first batch, its backend encodes the other two"
        np.testing.assert_array_equal(through_backend.ids, through_call.ids)
        np.testing.assert_array_equal(through_backend.lengths, through_call.lengths)
        assert (through_backend.lengths == 10).sum() == 3, "three texts are truncated"


def test_a_subset_is_a_view_whose_batches_are_the_parents_rows(tokenizer):
    tokens = tokenize(TEXTS, tokenizer, max_length=16, texts_key="subset/train")
    rows = np.array([5, 1, 1, 3])
    subset = tokens.subset(rows)
    assert subset.ids is tokens.ids and np.shares_memory(subset.ids, tokens.ids)
    assert len(subset) == 4 and subset.lengths.tolist() == tokens.lengths[rows].tolist()
    for a, b in zip(subset.batch(np.array([0, 3, 1])), tokens.batch(rows[[0, 3, 1]])):
        assert a.equal(b)
    assert_same_documents(subset.subset(np.array([2, 0])), tokens.subset(np.array([1, 5])))


def test_many_small_batches_write_what_one_batch_writes(tokenizer):
    small = tokenize(TEXTS, tokenizer, max_length=16, texts_key="small-batches/train", batch_size=3)
    large = tokenize(TEXTS, tokenizer, max_length=16, texts_key="one-batch/train", batch_size=1000)
    np.testing.assert_array_equal(small.ids, large.ids)
    np.testing.assert_array_equal(small.lengths, large.lengths)
    np.testing.assert_array_equal(small.starts, large.starts)


def test_a_write_that_was_killed_leaves_no_entry_and_is_redone(tokenizer):
    entry = cache_entry("killed/train", tokenizer, 16)
    failing = CountingTokenizer(tokenizer, fail_on_call=2)
    with pytest.raises(RuntimeError, match="killed"):
        tokenize(TEXTS, failing, max_length=16, texts_key="killed/train", batch_size=3)
    assert not entry.exists() and not list(entry.parent.glob(f".{entry.name}.*")), "nothing is left behind"
    # What SIGKILL leaves behind: a half written temporary folder beside the entry, and no entry.
    leftover = entry.parent / f".{entry.name}.abc123.tmp"
    leftover.mkdir()
    (leftover / "ids.bin").write_bytes(np.arange(5, dtype="<i4").tobytes())
    np.save(leftover / "lengths.npy", np.array([5], dtype=np.int64))
    old_format = entry.parent / f"{entry.name.removesuffix('.v2')}.npz"
    old_format.write_bytes(b"an entry of the previous format")

    counting = CountingTokenizer(tokenizer)
    tokens = tokenize(TEXTS, counting, max_length=16, texts_key="killed/train", batch_size=3)
    assert counting.calls == 3, "the leftovers are not taken for an entry"
    np.testing.assert_array_equal(tokens.ids, tokenize(TEXTS, tokenizer, max_length=16, texts_key=None).ids)
    assert sorted(path.name for path in entry.iterdir()) == ["ids.bin", "lengths.npy"]


def test_a_damaged_entry_is_reported(tokenizer):
    tokenize(TEXTS, tokenizer, max_length=16, texts_key="damaged/train")
    ids_path = cache_entry("damaged/train", tokenizer, 16) / "ids.bin"
    ids_path.write_bytes(ids_path.read_bytes()[:-4])
    with pytest.raises(XmcError, match="damaged.*delete that folder"):
        tokenize(TEXTS, tokenizer, max_length=16, texts_key="damaged/train")


def test_no_texts(tokenizer):
    for _ in range(2):   # written, then read
        tokens = tokenize([], tokenizer, max_length=16, texts_key="empty/train")
        assert len(tokens) == 0 and tokens.ids.shape == (0,)
        input_ids, attention_mask = tokens.batch(np.array([], dtype=np.int64))
        assert input_ids.shape == attention_mask.shape == (0, 0)
        assert len(tokens.subset(np.array([], dtype=np.int64))) == 0
    assert len(tokenize([], tokenizer, max_length=16, texts_key=None)) == 0
